"""Tools shared by the tests, the benches and ``flatgrad demo``; production modules never import them.

* ``launch``: run a function on W real processes joined in one process group.
* ``deepspeed_rank``: DeepSpeed inside such a rank, over the group the launcher made.
* ``collectives``: record and count the collectives a rank issues, at ``deepspeed.comm``,
  ``torch.distributed`` and flatgrad's comm layer.
* ``census``: the tensor bytes a process holds, now and at the peak (CPU: a counting allocator,
  the extension ``flatgrad._census``).
* ``host_writes``: count the writes into given host buffers (torch's and flatgrad's unpacks).
* ``placement``: CUDA's device rule on a CPU machine (``cpu`` and ``meta`` as host and accelerator).
* ``reference``: a whole engine's step gradient and update computed without ZeRO, and their rounding bounds.
"""
