"""``flatgrad demo``: the seed thread's MoE model trained under stock DeepSpeed and flatgrad, side by side.

Its ranks run under ``flatgrad.testing.launch``, the launcher the multi-rank tests and benches use.

* ``setups``: the rows (stock / flatgrad, ZeRO-2 / ZeRO-3), their DeepSpeed
  configs, models (from ``flatgrad.plan.models``) and batches.
* ``measure``: every collective recorded at ``deepspeed.comm`` and
  ``torch.distributed``, and the bytes a rank sends.
* ``train``: one rank's body: build the engines, train them in turns, measure.
* ``report``: the figures, the text table, the PNG chart.
* ``command``: the ``flatgrad demo`` subcommand.
"""
