"""Where serve's runs execute, each a :class:`~aimu.serve.backends.base.RunsBackend`:

- :mod:`.local`: in this process (``aimu serve``);
- :mod:`.redis`: here, registered with a ``RedisControl``, and every run on the same
  Redis found, followed and stopped through it (``aimu serve --redis``);
- :mod:`.temporal`: as workflows on Temporal workers (``aimu serve --temporal``).

Their shared parts: :mod:`.base` is the contract between them and the runs service
(what a backend reports and takes), :mod:`.launcher` executes runs in this process,
:mod:`.run_log` keeps the numbered events of runs followed here, :mod:`.decisions`
records decisions in the shared store, :mod:`.hosted` holds these for the two backends
whose runs execute here.
"""
