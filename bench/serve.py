"""The online load generator, ``ksana bench serve``, as a script: ``python bench/serve.py --base-url URL ...``.

It lives in the installed package (``ksana/bench/serve.py``) so that it works from a wheel too.
"""

import sys

from ksana.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
