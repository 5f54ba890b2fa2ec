"""The matchers: pure functions from an FX graph to typed records, shared by capture (which re-rolls what they
find) and recognize (which runs them all on the normalized graph). They read the graph and never change it.

* :mod:`.find_recurrences` — ``linear_scan``, torch's ``scan`` and ``associative_scan`` nodes, with their carry
  classified (linear, gated, general);
* :mod:`.unrolled` — Python loops that dynamo unrolled: the carry chain, the proof that every step is the same
  computation, the re-roll recipe;
* :mod:`.find_cells` — loops over ``nn.GRUCell`` / ``nn.LSTMCell``;
* :mod:`.find_residuals` — residual chains along depth, with each layer's r/g split and K;
* :mod:`.find_scan_forms`, :mod:`.find_generic_scan`, :mod:`.find_tree_scans` — closed forms (log-space, cumprod),
  generic-mode ``associative_scan`` trees and tree scans written in torch;
* :mod:`.prefilter` — which matcher families have a candidate at all, so that the others are not run.
"""
