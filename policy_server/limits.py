"""Bounds on what a client may ask for, shared by the config, the wire and the engine.

One place for each rule: the layer that validates imports it from here, and ``ServerInfo.limits``
publishes it, so the config, the transport and the engine cannot disagree.
"""

MAX_RESIDUAL_ORDER = 2  # SeaCache's Newton extrapolation: 0 reuse, 1 linear, 2 quadratic

MAX_INSTRUCTION_TOKENS = 128  # a task instruction, in tokens of the model's tokenizer
MAX_PROMPT_TOKENS = 512  # a Reason prompt, in tokens
# UTF-8 bytes of an instruction or prompt, checked before tokenizing so that tokenizing is cheap. A
# token covers at least one byte, so no text within the token limits is refused by this one.
MAX_TEXT_BYTES = 16 * 1024

MAX_BUDGET_MS = 60_000.0  # a session's per-tick latency budget
MAX_RATE_HZ = 1_000.0  # a session's declared chunk-request rate
MAX_TEMPERATURE = 100.0  # Reason sampling temperature (0 = greedy)
MAX_FRAME_SIDE = 4096  # pixels, of a camera frame the server resizes itself (the WebSocket adapter)
MAX_FRAME_RATE_HZ = 100.0  # observation frames per second on one Control stream (decoding them costs CPU)
