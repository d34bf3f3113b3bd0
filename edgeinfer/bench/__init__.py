"""``edgeinfer bench``: speed and memory of models on this machine, beside the peers.

``run_bench(BenchSettings(models=(...), ...))`` measures and returns a ``BenchReport``
(``.text()``, ``.to_dict()``, ``.plot(path)``); ``python -m edgeinfer.bench.worker`` is the
fresh process each run happens in.
"""

from .report import BenchReport
from .runner import BenchSettings, run_bench

__all__ = ["BenchReport", "BenchSettings", "run_bench"]
