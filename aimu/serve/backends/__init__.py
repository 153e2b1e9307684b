"""Where serve's runs execute, each a :class:`~aimu.serve.runs.RunsBackend`:

- :mod:`.local`: in this process (``aimu serve``);
- :mod:`.redis`: here, registered with a ``RedisControl``, and every run on the same
  Redis found, followed and stopped through it (``aimu serve --redis``);
- :mod:`.temporal`: as workflows on Temporal workers (``aimu serve --temporal``).

Their shared parts: :mod:`.launcher` executes runs in this process, :mod:`.run_log`
keeps the numbered events of runs followed here, :mod:`.decisions` records decisions
in the shared store.
"""
