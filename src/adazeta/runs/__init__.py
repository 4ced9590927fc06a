"""A run's directory and what it holds: its ownership and stop signals (``rundir``), its record ``result.json``
(``record``, written by a run; ``results``, read by the tools and tables) and the adapters it saves (``saving``,
loaded back by ``adazeta.load_adapters``)."""
