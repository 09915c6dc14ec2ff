"""The Helion kernels and everything that chooses and launches them.

- :mod:`.decode` (with :mod:`.decode_math`): the ReplaySSM decode kernel.
- :mod:`.cursor`: the pool's cursor advance kernel (and its torch form).
- :mod:`.verify` (with :mod:`.verify_plan`, :mod:`.verify_args`, :mod:`.verify_launch`) and :mod:`.commit`: speculative
  decoding's verify kernel and commit kernels (docs/spec.md).
- :mod:`.plan`: :func:`~.plan.plan_decode`, the one place that decides how a decode launch is compiled.
- :mod:`.args`: the kernel's arguments (views of the call's tensors) and where each comes from.
- :mod:`.launch`: :func:`~.launch.run_decode`, the entry of every decode: validate, choose the path, plan, launch.
- :mod:`.direct`: eager launches that skip Helion's and Triton's per-call dispatch.
- :mod:`.backend` and :mod:`.interpreter`: CPU tensors (the PyTorch path, or the kernels in Triton's interpreter).
- :mod:`.byte_model`: the bytes a decode step must move, the floor the kernels are measured against.
"""
