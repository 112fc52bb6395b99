"""``flatgrad demo``: the seed thread's MoE model trained under stock DeepSpeed and flatgrad, side by side.

Its ranks run under ``flatgrad.testing.launch`` and record their collectives with
``flatgrad.testing.collectives``, the tools the multi-rank tests and benches use.

* ``setups``: the rows (stock / flatgrad, ZeRO-2 / ZeRO-3), their DeepSpeed
  configs, models (from ``flatgrad.planner.models``) and batches.
* ``train``: one rank's body: build the engines, train them in turns, measure.
* ``report``: the figures, the text table, the PNG chart.
* ``command``: the ``flatgrad demo`` subcommand.
"""
