"""Graph analysis shared by the passes and the runtime: the lowest layer above the kernels.

* :mod:`.fx`: FX graph utilities (linear_scan nodes, example values and symbolic-safe shapes, reachability,
  convexity, a stable topological sort);
* :mod:`.optable`: the one table of torch-level op spellings and the op categories the passes use;
* :mod:`.affine`: is a value ``C ⊙ h + O`` in a carried value ``h`` (recognition and re-rolling);
* :mod:`.time_local`, :mod:`.rules`, :mod:`.layout_rules`, :mod:`.grow`: which nodes act on each step on its own,
  and the regions grown around the scans from them;
* :mod:`.breaks`: dynamo's graph breaks, and what the backend saw under one ``torch.compile`` call (for ``report()``
  and for one warning about the small graphs that breaks split off).

Nothing here imports :mod:`adjoint_compile.passes` or :mod:`adjoint_compile.runtime`.
"""
