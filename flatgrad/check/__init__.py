"""``flatgrad check``: validate flatgrad on a GPU node from the installed package, in one budgeted run.

The runner (``command``, ``plan``, ``runner``, ``summary``) runs each step in its own process; the
in-package steps are modules of this package, each runnable as ``python -m flatgrad.check.<module>``:

* ``env``: Python, torch, CUDA, NCCL, Triton, DeepSpeed, nvcc and every GPU.
* ``backends``: ``flatgrad.available_backends()``; the ``cuda`` and ``triton`` backends must run on CUDA tensors.
* ``kernels``: pack/unpack and their plans on ``cuda`` and ``triton``, bitwise against the ``torch`` reference.
* ``zero_offload``: ZeRO-2/3 with CPU optimizer offload, stock DeepSpeed against flatgrad, losses and memory.
* ``streams``: the reducer's shard delivery and the two-stage reduction's stream order on one GPU.
* ``wire``: every wire mode on ``cuda`` and ``triton``, bitwise against the reference.
* ``zero_step``: ZeRO-2 and ZeRO-3 steps on every visible GPU, stock against flatgrad.
* ``qgz``: ``qgz_int8`` / ``qgz_fp8`` and DeepSpeed's ZeRO++ qgZ on simulated ranks, error and bytes.

With ``--root CHECKOUT`` the check also builds the checkout's extension and runs its GPU tests.
This is the top layer, beside the CLI: it may import everything below it.
"""
