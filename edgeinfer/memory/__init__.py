"""Memory, planned before anything is allocated and measured after.

- ``budget``: ``MemoryBudget`` (the budget a plan must fit, made once) and ``MemoryPlan``;
- ``plan``: ``plan_memory``, a model's plan added up from its shape and the engine's costs;
- ``shape``: what the plan needs to know about a model, read from its own metadata;
- ``costs``: each engine's measured constants;
- ``rss``: the process's resident set, its peak and the mapped files.
"""
