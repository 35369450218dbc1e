"""Suite-wide setup: child Pythons keep the working directory off ``sys.path``.

The design's top-level folders install as ``ksana.events``, ``ksana.kernels``, ... A Python started in a checkout's
root with the working directory on ``sys.path`` would find the folder ``kernels/`` as a top-level package and
shadow Hugging Face's ``kernels``, which ``transformers`` imports; ``PYTHONSAFEPATH`` keeps every subprocess the
tests start (servers, tensor-parallel ranks, the CLI) importing the installed package, as a user's would.
"""

import os

os.environ["PYTHONSAFEPATH"] = "1"
