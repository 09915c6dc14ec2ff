"""The Helion kernels and everything that chooses and launches them.

- :mod:`.decode` (with :mod:`.decode_chunks`, :mod:`.decode_conv`, :mod:`.decode_math`, :mod:`.decode_compile`): the
  ReplaySSM decode kernel; :mod:`.plan` (``plan_decode``, the one place that decides how a decode launch is
  compiled), :mod:`.args` (its arguments, each tagged with the input it views), :mod:`.launch` (``run_decode``, the
  entry of every decode: validate, choose the path, plan, launch).
- :mod:`.cursor`: the pool's cursor advance kernel (and its torch form).
- :mod:`.conv` (with :mod:`.conv_once`, :mod:`.conv_plan`, :mod:`.conv_math`): the short causal convolution over a
  slot's window, in a launch of its own; the decode kernel runs the same math itself where its plan fuses it.
- :mod:`.fork`: the pool's fork (slots become byte copies of others, every layer) in one launch.
- :mod:`.verify` (with :mod:`.verify_plan`, :mod:`.verify_args`, :mod:`.verify_launch`) and :mod:`.commit`:
  speculative decoding's verify of T drafts and the commit of the accepted ones.
- :mod:`.direct`: eager launches that skip Helion's and Triton's per-call dispatch (every kernel launches through it).
- :mod:`.backend` and :mod:`.interpreter`: CPU tensors (the PyTorch path, or the kernels in Triton's interpreter).
- :mod:`.byte_model`: the bytes a decode step must move, the floor the kernels are measured against.
"""
