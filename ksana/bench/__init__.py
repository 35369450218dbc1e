"""What the installed package carries of the benchmarks: the load generator (``ksana bench serve``) and the
result-JSON writer every script in ``bench/`` shares."""
