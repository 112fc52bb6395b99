"""Tools shared by the tests, the benches and ``flatgrad demo``; production modules never import them.

* ``launch``: run a function on W real processes joined in one process group.
* ``collectives``: record and count the collectives a rank issues, at ``deepspeed.comm``,
  ``torch.distributed`` and flatgrad's comm layer.
* ``census``: the tensor bytes a process holds, now and at the peak (CPU: a counting allocator,
  the extension ``flatgrad._census``).
"""
