"""Batch jobs over files: ``edgeinfer batch MODEL IN.jsonl -o OUT.jsonl``.

``records`` checks input rows and builds output records, ``files`` reads the input within
bounds (one row per row of the file), ``output`` locks the output for one job and appends
to it crash-safely, ``job`` runs the ordered, resumable job on one machine, ``ray_job`` runs
the same rows on a Ray cluster (``edgeinfer[ray]``), and ``meter`` draws the progress line.
"""

from __future__ import annotations

from .job import BatchSummary, run_batch

__all__ = ["BatchSummary", "run_batch"]
