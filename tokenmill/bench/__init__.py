"""``tokenmill bench``: the front end's benchmarks, one module per scenario (``command`` lists them),
what they share in ``common`` (figures, corpus, loopback HTTP, prober, process accounting, options),
``servers`` (process handles, also the test suite's) and ``load_client``. Importing the package
imports nothing: ``parsers_vllm`` runs in vLLM's environment."""
