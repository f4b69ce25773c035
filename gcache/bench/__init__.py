"""Every gcache benchmark, each a ``gcache bench`` subcommand (``cli.py`` parses them; the
smaller ones also run as ``python -m gcache.bench.<module>``). Results go to ``bench/results``
unless ``--out`` / ``--json`` say otherwise; ``bench/RESULTS.md`` records measured figures."""
