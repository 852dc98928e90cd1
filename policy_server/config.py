"""Server configuration: one pydantic model behind every CLI flag, config-file key and environment variable.

A config file (YAML or JSON, ``--config FILE``) may set any field; keys use the field names
(``latency_budget_ms``) or the flag spelling (``latency-budget-ms``). An environment variable
``POLICY_SERVER_<FIELD>`` (``POLICY_SERVER_LATENCY_BUDGET_MS=90``) sets one for a container; one set to the empty
string is unset (docker compose's ``${VAR:-}``), as is an empty ``POLICY_SERVER_CONFIG`` or ``POLICY_SERVER_CACHE``.
Flags given on the command line override the environment, which overrides the file. Unknown keys and bad values are
rejected with an error naming the key and where it came from, and so is a ``POLICY_SERVER_`` variable
that names no setting.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from policy_server.limits import MAX_BUDGET_MS, MAX_CACHE_THRESHOLD, MAX_RESIDUAL_ORDER, MIN_TOKEN_CHARS
from policy_server.pipeline.hub import is_hub_id
from policy_server.v1.auth_token import read_token_file

ENV_PREFIX = "POLICY_SERVER_"
CONFIG_ENV = f"{ENV_PREFIX}CONFIG"  # the config file
PROFILE_CACHE_ENV = f"{ENV_PREFIX}CACHE"  # where quality profiles of read-only checkpoints go
ENV_NOT_SETTINGS = (CONFIG_ENV, PROFILE_CACHE_ENV)
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
MAX_CONFIG_FILE_BYTES = 1 << 20
DTYPES = ("auto", "bf16", "fp16", "fp32")  # auto: bf16 on CUDA, fp32 on CPU (engine.resolve_dtype)
_NUMBERS = (int, float, int | None, float | None)  # the annotations of the number settings
_PATHS = ("checkpoint", "unix_socket", "auth_token_file", "tls_cert", "tls_key")
# The SeaCache ladder's settings: ticks plan on the ladder only with the cache on and no quality profile.
LADDER_SETTINGS = ("diffusion_cache_thresh", "diffusion_cache_residual_order", "diffusion_cache_max_consecutive")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each offending key."""


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and key, loaded once by the settings' check: what every listener serves."""

    context: ssl.SSLContext = field(compare=False)  # /metrics and the openpi WebSocket; equal if its PEM is
    key_pem: bytes  # gRPC's credentials, read right after `context` loaded the files
    cert_chain_pem: bytes


_EVERY_INTERFACE = {"0.0.0.0", "::"}  # a listener there holds its port on every address
MAX_UNIX_SOCKET_BYTES = 107  # an AF_UNIX address holds 108 bytes, gRPC's path and its terminating NUL


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Latency budget and model
    latency_budget_ms: float = Field(
        120.0, gt=0, le=MAX_BUDGET_MS, allow_inf_nan=False,
        description="default per-tick latency budget (ms) of new sessions",
    )
    checkpoint: Path | None = Field(
        None, description="checkpoint folder or Hugging Face Hub id (org/name[@revision]); unset = the embedded model"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: str = Field("auto", description="weight dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32")
    cuda_graphs: bool = Field(True, description="on CUDA, replay the GEN stack from CUDA graphs captured at warmup")
    compile_gen_stack: bool | None = Field(
        None, description="run the GEN stack (on a CPU, the prefill and step work too) compiled at warmup (unset: "
                          "wherever torch can compile)")
    quality_profile: str = Field(
        "auto", min_length=1,
        description="off, auto (beside the checkpoint, else the cache directory, else calibrate at warmup) or a file")

    # Diffusion step cache (SeaCache)
    diffusion_cache: bool = Field(True, description="enable SeaCache (off = bit-exact uncached sampling)")
    diffusion_cache_thresh: float = Field(
        0.25, gt=0, le=MAX_CACHE_THRESHOLD, allow_inf_nan=False,
        description="SEA accumulated relative-L1 threshold (above 0: --no-diffusion-cache caches nothing)",
    )
    diffusion_cache_residual_order: int = Field(
        1, ge=0, le=MAX_RESIDUAL_ORDER, description="Newton extrapolation order (0 = reuse, 1 = linear, 2 = quadratic)"
    )
    diffusion_cache_max_consecutive: int = Field(
        2, ge=0, description="max consecutive cached steps per CFG branch (0 = no cap)"
    )

    # Network
    host: str = Field("127.0.0.1", min_length=1, description="bind address (loopback by default)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC TCP port (0 = any free port)")
    unix_socket: Path | None = Field(None, description="also serve gRPC on this Unix domain socket")
    websocket_port: int | None = Field(
        None, ge=0, le=65535, description="openpi-compatible WebSocket port (unset = off)"
    )
    websocket_embodiment: str | None = Field(
        None, min_length=1, description="embodiment of WebSocket sessions (unset = first)"
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port (unset = off)"
    )
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="/metrics bind address (loopback unless asked otherwise)"
    )
    reflection: bool = Field(False, description="enable gRPC server reflection")

    # Limits
    # Bounded: it sizes the gRPC thread pool (two threads a session, app.max_concurrent_calls) and the WebSocket
    # connection limit.
    max_sessions: int = Field(4, ge=1, le=64, description="concurrent sessions")
    max_batch: int = Field(4, ge=1, le=64, description="queued ticks of one shape run together (1 = no micro-batching)")
    max_dynamics_calls: int = Field(
        0, ge=0, le=8, description="forward / inverse dynamics calls at once (0 = off; on, every session's admission "
        "reserves the longest piece of one such call)"
    )
    # Below 1 GiB: gRPC takes messages up to twice it (to answer PAYLOAD_TOO_LARGE itself), and its receive limit
    # is an int32 (2 GiB failed the start with an OverflowError).
    max_message_mb: float = Field(
        16.0, gt=0, lt=1024, allow_inf_nan=False, description="max request size (MiB)"
    )
    session_idle_timeout_s: float = Field(
        300.0, gt=0, le=86400, allow_inf_nan=False,
        description="a session (or openpi WebSocket connection) with no call for this long is closed",
    )

    # Security
    auth_token_file: Path | None = Field(None, description="file holding the bearer token clients must send")
    tls_cert: Path | None = Field(None, description="PEM certificate chain (with --tls-key)")
    tls_key: Path | None = Field(None, description="PEM private key (with --tls-cert)")
    _tls: ServerTls | None = PrivateAttr(None)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_number(cls, value: Any, info: ValidationInfo) -> Any:
        return no_boolean(value) if cls.model_fields[info.field_name].annotation in _NUMBERS else value

    @field_validator(*_PATHS, mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") is Path("."), the working folder
            raise ValueError(f"expected a path, got {value!r} (leave the setting out for none)")
        return value

    # Before pydantic's own check, which said only "Input should be a valid string" of a file's `device: 0`.
    @field_validator("device", mode="before")
    @classmethod
    def _known_device(cls, value: Any) -> str:
        if not isinstance(value, str) or not _DEVICE.match(value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, value: Any) -> str:
        check_dtype(value)
        return value

    @field_validator("quality_profile", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        if value is False:  # YAML reads `quality_profile: off` as False
            return "off"
        if not isinstance(value, str):
            raise ValueError(f"expected off, auto or a profile file, got {value!r} (YAML reads on / yes / true as "
                             "True; auto is the default)")
        return value

    @field_validator("quality_profile")
    @classmethod
    def _profile_setting(cls, value: str) -> str:
        if value not in ("off", "auto") and not Path(value).is_file():
            raise ValueError(f"{value!r} is neither off, auto nor an existing profile file")
        return value

    @field_validator("checkpoint")
    @classmethod
    def _folder_or_hub_id(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists() and not is_hub_id(value):
            raise ValueError(f"{str(value)!r} is neither an existing path nor a Hugging Face Hub id (org/name)")
        return value

    @field_validator("auth_token_file")
    @classmethod
    def _readable_token(cls, value: Path | None) -> Path | None:
        if value is not None:
            _server_token(value)  # a bad file is refused with the settings, before the model loads
        return value

    @field_validator("tls_cert", "tls_key")
    @classmethod
    def _path_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"path {str(value)!r} does not exist")
        return value

    @field_validator("host", "metrics_host")
    @classmethod
    def _resolvable_host(cls, value: str) -> str:
        # Checked with the settings: the listeners bind it once the model is loaded (minutes for a Cosmos3 checkpoint).
        # Whether this machine has the address is left to the bind, which says so in the OS's words, and so is a
        # lookup that failed for now (a resolver not reachable yet as a container starts).
        try:
            socket.getaddrinfo(value.strip("[]"), None, type=socket.SOCK_STREAM)
            return value
        except socket.gaierror as error:
            if error.errno not in (socket.EAI_NONAME, socket.EAI_NODATA):
                return value
            reason = error.strerror
        except UnicodeError as error:  # a name IDNA cannot encode
            reason = str(error)
        raise ValueError(f"names no address ({reason}); expected an address of this machine (127.0.0.1, 0.0.0.0, ::1, "
                         "::) or a name that resolves to one")

    @field_validator("unix_socket")
    @classmethod
    def _socket_path(cls, value: Path | None) -> Path | None:
        # Checked with the settings: gRPC binds it once the model is loaded, and said "Address already in use" of a
        # file that is no socket. A socket file stays: a stopped server's is bound over, a running one's refused then.
        if value is None:
            return value
        size = len(os.fsencode(value))
        if size > MAX_UNIX_SOCKET_BYTES:
            raise ValueError(f"path {str(value)!r} is {size} bytes; expected at most {MAX_UNIX_SOCKET_BYTES} (what an "
                             "AF_UNIX address holds): a shorter one, or one relative to the working folder")
        if not value.parent.is_dir():
            raise ValueError(f"folder {str(value.parent)!r} does not exist; expected the socket's path in a folder")
        if value.exists() and not value.is_socket():
            kind = "folder" if value.is_dir() else "file"
            raise ValueError(f"{str(value)!r} is a {kind}, not a socket; expected a new path (or a socket a stopped "
                             "server left)")
        return value

    @model_validator(mode="after")
    def _listener_settings_need_their_listener(self) -> ServerConfig:
        if "websocket_embodiment" in self.model_fields_set and self.websocket_port is None:
            raise ValueError("websocket_embodiment is set but websocket_port is not: no WebSocket serves it")
        if "metrics_host" in self.model_fields_set and self.metrics_port is None:
            raise ValueError("metrics_host is set but metrics_port is not: no metrics endpoint listens on it")
        return self

    @model_validator(mode="after")
    def _planning_settings_need_the_cache(self) -> ServerConfig:
        # Given, they would go unused without a word: an uncached tick plans nothing, and a profile's configurations
        # set their own threshold, cap and residual order.
        ladder = self.ladder_settings_given()
        given = "quality_profile" in self.model_fields_set and self.quality_profile != "off"
        profile = ["quality_profile"] if given else []
        if not self.diffusion_cache and ladder + profile:
            raise ValueError(f"{', '.join(ladder + profile)} set but diffusion_cache is off: every tick runs uncached "
                             "and plans nothing; expected the cache on, or these settings left out")
        if ladder and self.quality_profile not in ("auto", "off"):
            raise ValueError(ladder_settings_overridden(ladder, self.quality_profile))
        return self

    @model_validator(mode="after")
    def _listeners_take_ports_of_their_own(self) -> ServerConfig:
        # Checked with the settings: bound once the model is loaded, a clash would end the start then, as "Address
        # already in use", which sends its user looking for another process.
        taken = {"port": (self.host, self.port)}
        for name, host, port in (("websocket_port", self.host, self.websocket_port),
                                 ("metrics_port", self.metrics_host, self.metrics_port)):
            if not port:  # None: off; 0: any free port
                continue
            for other, (other_host, other_port) in taken.items():
                if other_port == port and (_addresses(other_host) & _addresses(host)
                                           or {other_host, host} & _EVERY_INTERFACE):
                    hosts = host if other_host == host else f"{host} and {other_host}"
                    raise ValueError(f"{name} {port} is {other} too, on {hosts}: expected a port of its own")
            taken[name] = (host, port)
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_cert is not None:  # checked with the settings: gRPC would only fail to bind, after the warmup began
            try:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(self.tls_cert, self.tls_key)
                # TLS 1.3 sends session tickets after the handshake, while websockets' sync client (openpi's) writes
                # its upgrade request on one thread as another reads: Python's TLS sockets are not safe for that,
                # and about 1 connection in 270 lost its request. A robot connects once; it needs no resumption.
                context.num_tickets = 0
                self._tls = ServerTls(context, self.tls_key.read_bytes(), self.tls_cert.read_bytes())
            except OSError as error:  # unreadable, or not PEM (ssl.SSLError)
                raise ValueError(f"tls_cert {str(self.tls_cert)!r} and tls_key {str(self.tls_key)!r}: expected a PEM "
                                 f"certificate chain and its private key ({error.strerror or error})") from None
        return self

    def ladder_settings_given(self) -> list[str]:
        """The `LADDER_SETTINGS` given (by a file, the environment or a flag), which a quality profile overrides."""
        return [name for name in LADDER_SETTINGS if name in self.model_fields_set]

    def given(self) -> str:
        """The settings given (by a file, the environment or a flag) with their values, in field order: the log's."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in type(self).model_fields
                         if name in self.model_fields_set)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 1024 * 1024)

    @property
    def tls(self) -> ServerTls | None:
        """The TLS pair as the settings' check loaded it (None without `tls_cert`): the files are not read again."""
        return self._tls

    def auth_token(self) -> str | None:
        """The bearer token clients must send (read from `auth_token_file`), None without one."""
        return None if self.auth_token_file is None else _server_token(self.auth_token_file)


def no_boolean(value: Any) -> Any:
    """`value`, a number setting's, unless it is a boolean: pydantic takes True / False as 1 / 0, and YAML reads off /
    no as False (`websocket_port: off` would serve on a random port)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value} (YAML reads on / off / yes / no as booleans; leave a "
                         "setting out for its default)")
    return value


def ladder_settings_overridden(given: list[str], profile: str | Path) -> str:
    """Why the `LADDER_SETTINGS` `given` cannot be used with the quality profile `profile` (its file)."""
    return (f"{', '.join(given)} set but ticks plan on the quality profile {profile}, whose configurations set their "
            "own threshold, cap and residual order; expected quality_profile off to plan on the SeaCache ladder these "
            "settings define")


def _addresses(host: str) -> set[str]:
    """The addresses a listener on `host` binds, as far as they are known without a name lookup: localhost's."""
    return {"127.0.0.1", "::1"} if host == "localhost" else {host}


def _server_token(path: Path) -> str:
    """The token `path` holds, if it is one a server may want: `MIN_TOKEN_CHARS` long at least (clients read
    whatever token they are given)."""
    token = read_token_file(path)
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"auth token in {path} is {len(token)} characters; expected at least {MIN_TOKEN_CHARS} (a "
                         "shorter one may be guessed by trying; e.g. openssl rand -hex 32 > token)")
    return token


def check_dtype(value: str) -> None:
    """Raise `ValueError` unless `value` is one of `DTYPES` (shared by the server's and bench's --dtype)."""
    if value not in DTYPES:
        raise ValueError(f"expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {value!r}")


def _normalise_keys(values: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} is not a string")
        name = key.replace("-", "_")
        if name in out:
            raise ConfigError(f"{source}: key {name!r} is given twice")
        out[name] = value
    return out


def chosen_config_file(args: dict[str, Any], environ: Mapping[str, str]) -> str | None:
    """The settings file: ``--config`` (taken out of the parsed flags `args`), else ``$POLICY_SERVER_CONFIG``
    unless empty (unset, as for the settings' variables)."""
    return args.pop("config") if "config" in args else environ.get(CONFIG_ENV) or None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Load a YAML (.yaml/.yml) or JSON (.json) mapping of config keys, UTF-8 text of at most 1 MiB."""
    if not str(path).strip():
        raise ConfigError(f"config file {str(path)!r}: expected the path of a .yaml, .yml or .json file")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; expected a .yaml, .yml or .json file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with path.open("rb") as f:
        raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"config file {path} is over {MAX_CONFIG_FILE_BYTES} bytes; expected a short settings file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: expected UTF-8 text, got a byte that is not UTF-8 at offset "
                          f"{exc.start}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = _load_yaml(text)
        elif path.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            raise ConfigError(f"config file {path}: expected a .yaml, .yml or .json file")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - yaml and json raise different types
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {_one_line(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys, got {type(data).__name__}")
    return _normalise_keys(data, str(path))


def _one_line(exc: Exception) -> str:
    """The parser's complaint on one line: PyYAML's spans several (the offending line, a caret under it)."""
    mark = getattr(exc, "problem_mark", None)
    if getattr(exc, "problem", None) and mark is not None:
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is an error (json's own rule is: the last one wins)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"duplicate key {key!r}")
        data[key] = value
    return data


def _load_yaml(text: str) -> Any:
    import yaml  # imported here: JSON configs and flag-only runs do not need PyYAML

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader, except that a mapping key given twice is an error (PyYAML's rule is: the last one wins)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):  # keys that are not scalars fail in SafeLoader anyway
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
                    seen.add(key_node.value)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def environment_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings among ``environ``'s variables: ``POLICY_SERVER_<FIELD>`` for each ``ServerConfig`` field.
    One set to the empty string is unset. Any other variable with the prefix, but `ENV_NOT_SETTINGS`, is a
    `ConfigError` whatever its value: a misspelt setting in a container's environment would otherwise be ignored
    without a word."""
    values = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_SETTINGS:
            continue
        field = name.removeprefix(ENV_PREFIX).lower()
        if field not in ServerConfig.model_fields:
            close = difflib.get_close_matches(field, ServerConfig.model_fields, n=1)
            hint = f"did you mean ${ENV_PREFIX}{close[0].upper()}? " if close else ""
            raise ConfigError(f"${name} is not a setting; {hint}expected ${ENV_PREFIX}<FIELD> for a field of "
                              f"`policy-server --help` (--max-sessions: ${ENV_PREFIX}MAX_SESSIONS), or one of "
                              f"{', '.join('$' + other for other in ENV_NOT_SETTINGS)}")
        if value:  # empty is unset: docker compose's `${VAR:-}` passes a variable the host does not set as ""
            values[field] = value
    return values


def build_config(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None, source: str = "config",
    environment: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Validate file values (from ``source``), then the settings in ``environment`` over them, then the
    command-line ``overrides`` over both."""
    layers = (
        (_normalise_keys(file_values or {}, source), lambda key: source),
        (environment_values(environment or {}), lambda key: f"${ENV_PREFIX}{key.upper()}"),
        (_normalise_keys(overrides or {}, "command line"), lambda key: "command line"),
    )
    merged, origin = {}, {}
    for values, where in layers:
        merged.update(values)
        origin.update({key: where(key) for key in values})
    try:
        return ServerConfig(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "config"
            value = err.get("input")
            shown = str(value) if isinstance(value, Path) else value  # the path as given, not PosixPath('...')
            shows_input = "input" in err and not isinstance(value, dict) and "got " not in err["msg"]
            got = f" (got {shown!r})" if shows_input else ""
            message = err["msg"].removeprefix("Value error, ")  # pydantic's wording for a validator's own ValueError
            if err["type"] == "extra_forbidden":  # a misspelt key: say which setting it is close to, as for $variables
                close = difflib.get_close_matches(key, ServerConfig.model_fields, n=1)
                message = "not a setting; " + (f"did you mean {close[0]}?" if close else
                                               "expected the name of a flag of `policy-server --help`")
            problems.append(f"{key} (from {origin.get(key, 'the settings together')}): {message}{got}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None
