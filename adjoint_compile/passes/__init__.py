"""The backend's graph passes, one sub-package per stage, in pipeline order (``backend.py`` runs them once each):

1. :mod:`.capture` — dynamo's torch-level graph in; the same graph normalized (loops, scan ops, closed forms and
   registered scans as one ``linear_scan``, canonical shifts, seeded dropout) out, as a ``Captured`` record.
2. :mod:`.recognize` — the normalized graph in; typed region records (recurrences, residual chains) and the
   rejections of candidates not proven out.
3. :mod:`.decide` — the records and the options in; a plan per region (the rewrite to try, or why none) out; after
   lowering it writes each record's ``rewrite`` and ``reason``.
4. :mod:`.lower` — the graph and the plans in; the graph with each planned region replaced by one call of its
   runtime ``autograd.Function`` (``runtime/``), and per region a ``Lowered`` / ``NotLowered`` outcome, out.
5. :mod:`.stitch` — the lowered graph in; one callable out: the partitions between region calls compiled by the
   inner compiler.

:mod:`.match` holds the matchers that stages 1 and 2 share: pure functions from a graph to typed records. A module
imports only its own stage or earlier ones (``tests/test_architecture.py``).
"""
