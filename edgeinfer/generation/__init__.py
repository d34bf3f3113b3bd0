"""Generation: the one loop every request runs through, and what it hands out.

- ``scheduler``: ``Engine``, one thread stepping every running slot (``parallel=1`` is one
  slot); ``slots`` sees one slot as a single-sequence backend; ``turns`` orders the requests
  of a one-slot model; ``delivery`` carries a request's chunks to its caller;
- ``results``: one sequence's prefill and its results (``Chunk``, ``GenerationResult``,
  ``GenerationStats``, ``TokenStream``); ``generate_many`` keeps a window of requests running;
- ``sampling``, ``detokenizer``, ``structured``, ``structured_bounds``: logits to tokens to
  text, under a grammar where one is asked for;
- ``speculative``, ``draft_model``, ``draft_vocab``: drafting and one-pass verification;
- ``scoring``: teacher-forced log-probabilities (``Model.score``, ``logprobs``);
- ``state``: KV history, snapshots and the prompt cache, per slot.
"""
