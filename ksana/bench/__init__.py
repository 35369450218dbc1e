"""What the installed package carries of the benchmarks: the load generator (``ksana bench serve``), the request
trace it shares with the simulator, and the result-JSON writer every script in ``bench/`` uses."""
