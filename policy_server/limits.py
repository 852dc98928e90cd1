"""Bounds on what a client may ask for, shared by the config, the wire and the engine.

One place for each rule: the layer that validates imports it from here, and ``ServerInfo.limits``
publishes the ones a client must keep to, so the config, the transport and the engine cannot disagree.
"""

MAX_RESIDUAL_ORDER = 2  # SeaCache's Newton extrapolation: 0 reuse, 1 linear, 2 quadratic
# SeaCache's accumulated relative-L1 threshold (--diffusion-cache-thresh): far above what a tick's steps accumulate,
# and the planner's ladder, which runs to 4x it, stays below its most aggressive rung (planner.MAX_CACHING, 1e6).
MAX_CACHE_THRESHOLD = 1000.0

MAX_REASON_CALLS = 2  # Reason calls that run at once (each holds a server thread while it streams)
MAX_INSTRUCTION_TOKENS = 128  # a task instruction, in tokens of the model's tokenizer
MAX_PROMPT_TOKENS = 512  # a Reason prompt, in tokens
# UTF-8 bytes of an instruction or prompt, checked before tokenizing so that tokenizing is cheap. A
# token covers at least one byte, so no text within the token limits is refused by this one.
MAX_TEXT_BYTES = 16 * 1024
MAX_CLIENT_NAME_CHARS = 128  # OpenSessionRequest.client_name: printable text, for the server's log
# OpenSessionRequest.request_id: the caller's id of one opening (a uuid4 hex is 32 characters), of these characters.
# At least 16: whoever repeats an open session's id (and settings) gets that session, so it must not be guessable.
MIN_REQUEST_ID_CHARS, MAX_REQUEST_ID_CHARS = 16, 64
REQUEST_ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

MAX_BUDGET_MS = 60_000.0  # a session's per-tick latency budget
MAX_RATE_HZ = 1_000.0  # a session's declared chunk-request rate
# The slowest declared rate, a chunk every 100 s (0 declares a closed loop): a refusal's retry delay and a throttled
# frame's wait stay within what a RetryInfo holds and a timer takes.
MIN_RATE_HZ = 0.01
MAX_TEMPERATURE = 100.0  # Reason sampling temperature (0 = greedy)
# Pixels, the longest side of a camera frame at the boundary (gRPC and WebSocket); the pipeline downscales
# it to fit the model's canvas. A RAW frame at the limit (2048 x 2048 x 3 = 12 MiB) fits the default 16 MiB
# message, and a JPEG/PNG header is checked against it before the frame is decoded.
MAX_FRAME_SIDE = 2048
MAX_FRAME_RATE_HZ = 100.0  # observation frames per second on one Control stream (decoding them costs CPU)
# Each Control stream holds a server thread: one must send its `start` this soon, and this many may wait for
# theirs at once, so that streams that never start cannot take the threads other calls need.
CONTROL_START_S = 10.0
MAX_STARTING_STREAMS = 4
STARTING_RETRY_MS = 100.0  # when a stream refused for want of a place may try again
# Server reflection streams open at once (--reflection): each holds a server thread for as long as its client keeps
# it open, idle or not.
MAX_REFLECTION_STREAMS = 2
# Health Watch streams open at once: each holds server memory (about 23 kB) for as long as its client keeps it; a
# client waiting for a server to serve (`PolicyClient.wait_until_serving`) holds one.
MAX_HEALTH_WATCHES = 64
MAX_SERVICE_NAME_CHARS = 256  # a health call's service: a fully qualified gRPC service name
MAX_PENDING_FRAMES = 4  # `must_answer` frames waiting on one Control stream, each a message still to decode
# Events (chunks, pongs, errors, ...) one Control stream holds for a client that is not reading them; beyond them
# it reads none of the client's messages until the client reads.
MAX_QUEUED_EVENTS = 64
MAX_REFUSED_MESSAGES = 16  # refused in a burst on one openpi WebSocket connection (each ~12 ms of CPU at 12 MiB)
REFUSED_MESSAGES_HZ = 2.0  # refused per second beyond that burst; more close the connection (1008)
# A forward / inverse dynamics call runs uncached at the model's step count between ticks (ticks go first);
# it is abandoned after this long when its caller sets no shorter deadline.
MAX_DYNAMICS_MS = 30_000.0

# The server's auth token (not published: clients send whatever token they are given): every call may try one, and
# 16 random characters (64 bits as hex) put guessing out of reach where a few would not.
MIN_TOKEN_CHARS = 16
