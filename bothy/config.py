"""Bothy's configuration: one frozen, validated value loaded once by the CLI.

``$BOTHY_HOME/config.json`` is validated with pydantic; unknown keys are rejected. A bad file
raises :class:`~bothy.errors.ConfigError` naming the file, the key and what was expected, and
the CLI exits 78 (do not restart me). Every field is documented in ``docs/CONFIGURATION.md``;
a test keeps the two in step.

Secrets never live in this file: fields that need one name an environment variable or a file.
"""

# No `from __future__ import annotations` here: pydantic would have to eval every field's
# annotation from its text (~150 of them) when it makes the classes; written as objects they
# are evaluated by the module's own bytecode (issue 18: ~9 M instructions of every command).
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from bothy.errors import ConfigError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _env_names(names: list[str]) -> list[str]:
    for name in names:
        if not _ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not an environment variable name")
    return names


# Names of environment variables (secrets are passed by name, never written in config).
EnvNames = Annotated[list[str], AfterValidator(_env_names)]


class _Section(BaseModel):
    """A part of the configuration. An empty ``{}`` or ``[]`` default is written as a value,
    not ``default_factory=dict``: pydantic copies such a default for every instance all the
    same, and asks a factory for its signature when it builds the schema, which for a builtin
    means parsing its text signature (~20 ms of every command's start, issue 18).

    Each section's validator is built when it is first used (``defer_build``), not as its
    class is made: loading a config builds the whole tree once, for :class:`Config`, instead
    of every section's own first and then again inside its parent's."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class PoolConfig(_Section):
    """How many runs may work at once on this machine."""

    max_workers: int = Field(default=2, ge=1, le=64)


class Price(_Section):
    """USD per million tokens for one model."""

    input_per_mtok: Decimal = Field(ge=0)
    cached_input_per_mtok: Decimal = Field(ge=0)
    output_per_mtok: Decimal = Field(ge=0)


# In plan mode the dollar keys are optional and ignored (doctor says so); these stand in for
# them, so that code sizing a dollar reservation never meets a missing value.
PLAN_MODE_IGNORED_USD = Decimal("1000000")


class BudgetConfig(_Section):
    """What runs may spend: dollars (mode 'api') or a share of the plan's rate-limit windows
    (mode 'plan', for a ChatGPT plan whose limit is a window, not money)."""

    mode: Literal["api", "plan"] = "api"
    per_run_usd: Decimal = Field(gt=0)
    per_day_usd: Decimal = Field(gt=0)
    prices: dict[str, Price] = Field(default={})
    timezone: str = "UTC"
    reservation_expiry_s: int = Field(default=3600, ge=60, le=7 * 86400)
    plan_ceiling_percent: int = Field(default=85, gt=0, le=100)
    plan_reserve_percent: int = Field(default=2, gt=0, lt=100)

    @model_validator(mode="before")
    @classmethod
    def _dollars_optional_in_plan_mode(cls, value: object) -> object:
        if isinstance(value, dict) and value.get("mode") == "plan":
            value = {"per_run_usd": PLAN_MODE_IGNORED_USD,
                     "per_day_usd": PLAN_MODE_IGNORED_USD, **value}
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {value!r} (expected an IANA name)") from exc
        return value

    @model_validator(mode="after")
    def _run_fits_in_day(self) -> Self:
        if self.per_run_usd > self.per_day_usd:
            raise ValueError(
                f"per_run_usd ({self.per_run_usd}) is larger than per_day_usd ({self.per_day_usd})"
            )
        if self.plan_reserve_percent >= self.plan_ceiling_percent:
            raise ValueError(
                f"plan_reserve_percent ({self.plan_reserve_percent}) must be smaller than"
                f" plan_ceiling_percent ({self.plan_ceiling_percent})"
            )
        return self


# A key that names a credential, unless it names a variable holding one (``env_key``); and
# the shapes of well-known tokens wherever they appear.
_SECRET_KEY = re.compile(r"key|token|secret|passw|credential|authorization|bearer|cookie",
                         re.IGNORECASE)
_NAMES_A_VARIABLE = re.compile(r"(^|_)env_(key|vars?|http_headers)$|_env(_var)?$",
                               re.IGNORECASE)
_SECRET_VALUE = re.compile(
    r"^(sk-|sk_live_|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|xox[abpr]-|xapp-|AKIA[0-9A-Z]{12}"
    r"|AIza|Bearer\s|Basic\s)")
_SECRET_INLINE = "secret_inline"  # an error whose input must never be echoed


def _no_inline_secret(config: dict[str, Any], where: str = "codex.config") -> dict[str, Any]:
    """Refuse ``codex.config`` holding what looks like a secret: it would ride on the worker's
    command line as ``-c key=value``, readable by anyone running ``ps``."""
    stack: list[tuple[str, Any, bool]] = [(key, value, False) for key, value in config.items()]
    while stack:
        dotted, value, named = stack.pop()
        leaf = dotted.rsplit(".", 1)[-1]
        names = named or bool(_NAMES_A_VARIABLE.search(leaf))
        if isinstance(value, dict):
            stack += [(f"{dotted}.{key}", item, names) for key, item in value.items()]
        elif isinstance(value, list):
            stack += [(f"{dotted}[{index}]", item, names) for index, item in enumerate(value)]
        elif isinstance(value, str) and value and _looks_secret(leaf, value, names):
            raise PydanticCustomError(_SECRET_INLINE, (
                f"{where}.{dotted} holds what looks like a secret, which would ride on "
                "the worker's command line (visible in ps): remove it and pass it through the "
                "environment (list the variable in codex.env; a provider reads it by env_key) "
                "or a file only you can read (mode 0600)"))
    return config


def _looks_secret(leaf: str, value: str, names_a_variable: bool) -> bool:
    if _SECRET_VALUE.match(value):
        return True
    return not names_a_variable and bool(_SECRET_KEY.search(leaf.split("[", 1)[0]))


class CodexConfig(_Section):
    """How the worker is started: the codex app-server and what it may see."""

    command: list[str] = Field(default_factory=lambda: ["codex", "app-server"], min_length=1)
    home: Path | None = None
    model: str | None = None
    config: Annotated[dict[str, Any], AfterValidator(_no_inline_secret)] = Field(
        default={})
    env: EnvNames = Field(default=[])
    spare: StrictBool = True  # bothy serve keeps one app-server started ahead (engine/spare.py)


class CairnConfig(_Section):
    """How Bothy reaches Cairn, the optional task ledger (docs/CAIRN.md)."""

    command: list[str] = Field(default_factory=lambda: ["cairn"], min_length=1)
    # Each step (claim, brief, note, release) is bounded by this; the seed says 10 s at most.
    timeout_s: float = Field(default=10.0, gt=0, le=10)
    env: EnvNames = Field(default=[])


class LimitsConfig(_Section):
    """Default limits for every run; `bothy run` flags may tighten them."""

    wall_clock_s: int = Field(default=1800, ge=1, le=86400)
    max_tokens: int | None = Field(default=None, ge=1)
    max_turns: int | None = Field(default=None, ge=1)  # tool calls a run may make
    stop_grace_s: float = Field(default=5.0, gt=0, le=120)


# Tools Bothy knows without an MCP server: Codex's own approval requests, and Bothy's tools.
BUILTIN_TOOLS = frozenset({"shell", "apply_patch", "bothy_checklist", "bothy_note"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_.-]+)?$")


class McpServerConfig(_Section):
    """One MCP server a profile grants: started by Bothy, inside the run's process group."""

    command: str = Field(min_length=1)
    args: list[str] = Field(default=[])
    env: EnvNames = Field(default=[])  # names passed through; no secret is inline
    start_timeout_s: float = Field(default=20.0, gt=0, le=300)
    call_timeout_s: float = Field(default=60.0, gt=0, le=3600)


class Guide(_Section):
    """Refuse, and carry this reason back to the model."""

    guide: str = Field(min_length=1)


def _verdict_shape(value: object) -> object:
    if value in ("proceed", "deny", "confirm") or isinstance(value, Guide):
        return value
    if isinstance(value, dict) and set(value) == {"guide"}:
        return value
    raise ValueError('expected "proceed", "deny", "confirm" or {"guide": "<reason for the model>"}')


Verdict = Annotated[Literal["proceed", "deny", "confirm"] | Guide, BeforeValidator(_verdict_shape)]


class MemoryConfig(_Section):
    """A profile's memory (SPEC §8): caps per file, in characters, and how long day notes live.

    ``"memory": true`` in a profile means these defaults; an object sets some of them.
    """

    soul_chars: int = Field(default=6000, ge=100, le=100_000)
    memory_chars: int = Field(default=4000, ge=100, le=100_000)
    user_chars: int = Field(default=2000, ge=100, le=100_000)
    note_chars: int = Field(default=2000, ge=50, le=20_000)
    day_chars: int = Field(default=40_000, ge=1000, le=1_000_000)
    memory_retention_days: int = Field(default=30, ge=1, le=3650)
    search: Literal["fts5", "scan"] = "fts5"  # "scan" forces the case-insensitive scan


def _memory_shape(value: object) -> object:
    if value is True:
        return MemoryConfig()
    if value is False:
        return None
    if value is None or isinstance(value, (MemoryConfig, dict)):
        return value
    raise ValueError('expected true, false or an object such as {"memory_chars": 4000}')


class ProfileConfig(_Section):
    """What a task may use beyond Codex's sandboxed built-ins, tool by tool."""

    sandbox: Literal["read-only", "workspace-write", "danger-full-access"] = "read-only"
    mcp_servers: dict[str, McpServerConfig] = Field(default={})
    skills: list[Path] = Field(default=[])
    tools: list[str] = Field(default=[])
    approvals: dict[str, Verdict] = Field(default={})
    ask: list[str] = Field(default=[])
    unless_approved_within: int = Field(default=0, ge=0, le=30 * 86400)
    question_hold_seconds: int = Field(default=120, ge=0, le=86400)
    allow_from_untrusted: bool = False
    cairn_brief: bool = True  # a run with --ref reads its task's brief from Cairn first
    memory: Annotated[MemoryConfig | None, BeforeValidator(_memory_shape)] = None
    # Codex config keys for this profile's runs, over codex.config: such a run starts its own
    # app-server (the spare has the site's); no secret inline, as in codex.config.
    codex_config: Annotated[dict[str, Any], AfterValidator(
        lambda config: _no_inline_secret(config, "codex_config"))] = Field(default={})

    @field_validator("skills")
    @classmethod
    def _absolute_skills(cls, roots: list[Path]) -> list[Path]:
        for root in roots:
            if not root.is_absolute():
                raise ValueError(f"skill path '{root}' is relative: Codex needs absolute paths"
                                 " (write it from /)")
        return roots

    @model_validator(mode="after")
    def _known_tools(self) -> Self:
        for where, names in (("tools", self.tools), ("approvals", list(self.approvals)),
                             ("ask", self.ask)):
            for name in names:
                problem = _tool_problem(name, self.mcp_servers)
                if problem:
                    raise ValueError(f"{where}: {problem}")
        for name in [*self.approvals, *self.ask]:
            if name not in self.tools:
                raise ValueError(
                    f"'{name}' has a rule but is not granted: add it to tools, or remove the rule"
                )
        return self


def _tool_problem(name: str, servers: dict[str, McpServerConfig]) -> str | None:
    if not _TOOL_NAME.match(name):
        return f"'{name}' is not a tool name (expected e.g. shell or gmail.send_message)"
    if "." not in name:
        if name not in BUILTIN_TOOLS:
            known = ", ".join(sorted(BUILTIN_TOOLS))
            return f"unknown tool '{name}' (built-in tools: {known}; MCP tools are server.tool)"
        return None
    server = name.split(".", 1)[0]
    if server not in servers:
        return f"tool '{name}' names MCP server '{server}', which this profile does not define"
    return None


# The public HTTPS ports Tailscale Funnel allows (contracts.md: "443, 8443, 10000 only").
FUNNEL_PORTS = frozenset({443, 8443, 10000})
_FUNNEL_PORT_LIST = ", ".join(str(port) for port in sorted(FUNNEL_PORTS))


class ListenConfig(_Section):
    """Where `bothy serve` listens. Both bind 127.0.0.1: Tailscale carries traffic in."""

    tailnet_port: int = Field(default=8765, ge=1, le=65535)
    public_port: int | None = Field(default=None, ge=1, le=65535)
    # The HTTPS ports Tailscale opens on the node (`bothy install --serve`, `bothy funnel`).
    serve_port: int = Field(default=9443, ge=1, le=65535)
    funnel_port: int = 443

    @field_validator("funnel_port")
    @classmethod
    def _funnel_allows(cls, value: int) -> int:
        if value not in FUNNEL_PORTS:
            raise ValueError(f"Tailscale Funnel only opens ports {_FUNNEL_PORT_LIST}")
        return value

    @field_validator("serve_port")
    @classmethod
    def _serve_leaves_funnel_alone(cls, value: int) -> int:
        if value in FUNNEL_PORTS:
            raise ValueError(f"keep the tailnet door off Funnel's ports ({_FUNNEL_PORT_LIST}):"
                             " `tailscale serve` on a port turns Funnel off there")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if self.public_port == self.tailnet_port:
            raise ValueError("public_port must differ from tailnet_port: Funnel applies to a"
                             " whole port, so the public listener needs its own")
        return self


# Where an unattended run's findings are posted: a platform and a channel of its form.
_REPORT_CHANNEL = {
    "slack": (re.compile(r"^[CG][A-Z0-9]{1,20}$"), "a Slack channel id such as C0OPS"),
    "discord": (re.compile(r"^[0-9]{15,21}$"), "a Discord channel id (a snowflake of digits)"),
}


def report_to_form_problem(value: str) -> str | None:
    """Why ``value`` is not a report target (``slack:C0OPS``, ``discord:1234…``), or None."""
    platform, _, channel = value.partition(":")
    if platform not in _REPORT_CHANNEL:
        return (f"{value!r} is not a report target: expected slack:CHANNEL or discord:CHANNEL"
                " (e.g. slack:C0OPS)")
    pattern, expected = _REPORT_CHANNEL[platform]
    if not pattern.match(channel):
        return f"{value!r}: {channel!r} is not {expected}"
    return None


def report_to_problem(value: str, chat: "ChatConfig") -> str | None:
    """Why ``value`` cannot receive reports on this site (its form, or its platform is not
    configured under ``chat``), or None."""
    if problem := report_to_form_problem(value):
        return problem
    platform = value.partition(":")[0]
    if getattr(chat, platform) is None:
        return f"{value!r} names {platform}, but chat.{platform} is not configured"
    return None


def _report_target(value: str | None) -> str | None:
    if value is not None and (problem := report_to_form_problem(value)):
        raise ValueError(problem)
    return value


ReportTo = Annotated[str | None, AfterValidator(_report_target)]


class WakeJob(_Section):
    """What a wake starts: a prompt in a lane, under a profile, within a reservation."""

    prompt: str = Field(min_length=1)  # {dotted.fields} of the payload are framed as data
    subject: str = Field(default="{route}", min_length=1)  # lane template, e.g. pr:{number}
    profile: str | None = None
    max_usd: Decimal | None = Field(default=None, gt=0)
    ref: str | None = Field(default=None, min_length=1)  # task in Cairn, e.g. ACME-{issue.number}
    report_to: ReportTo = None  # where its findings go, e.g. slack:C0OPS; else the alert channel


class WebhookJob(WakeJob):
    """What a matching delivery wakes: a prompt in a lane, under a profile."""

    event: str = Field(min_length=1)  # X-GitHub-Event (github) or the route's event
    actions: list[str] = Field(default=[])  # payload "action"; empty = any
    author_associations: list[str] = Field(default=[])  # empty = anyone


# Where the status pages live on the tailnet door (bothy.web); no webhook route may be there.
PAGES_PREFIX = "/bothy/"


class WebhookRoute(_Section):
    """A signed route: GitHub's X-Hub-Signature-256, or a generic HMAC-SHA256 header."""

    kind: Literal["github", "hmac"] = "github"
    path: str = Field(pattern=r"^/[A-Za-z0-9/_.-]*$")
    public: bool = False  # served on the public listener (Funnel) instead of the tailnet door
    secret_env: EnvNames = Field(min_length=1)  # env var names; several allow rotation
    max_body_bytes: int = Field(default=5_000_000, ge=1024, le=25_000_000)
    signature_header: str = "X-Signature-256"  # hmac routes: "sha256=<hex>"
    delivery_header: str = "X-Delivery-Id"  # hmac routes: the dedupe key
    event_header: str = "X-Event"  # hmac routes
    jobs: list[WebhookJob] = Field(default=[])

    @field_validator("path")
    @classmethod
    def _clear_of_the_pages(cls, value: str) -> str:
        if value == PAGES_PREFIX.rstrip("/") or value.startswith(PAGES_PREFIX):
            raise ValueError(f"{value!r} is under {PAGES_PREFIX}, where bothy serve's status"
                             " pages live: choose another path, e.g. /hooks/github")
        return value


class WebConfig(_Section):
    """The status pages on the tailnet door (``/bothy/``): read-only, never on the public one."""

    enabled: bool = True
    # The variable holding the optional access token; unset or empty: no token is asked.
    token_env: str = Field(default="BOTHY_WEB_TOKEN", pattern=_ENV_NAME.pattern)
    refresh_s: int = Field(default=15, ge=2, le=3600)  # the pages reload themselves this often


# RFC 9110 §5.1: a field name is a token.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Sent by the poller itself, from its persisted cursor.
_CONDITIONAL_HEADERS = frozenset({"if-none-match", "if-modified-since"})
_DOTTED_PATH = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class PollItems(_Section):
    """Items mode: the body is JSON holding a list; each item whose ``id`` is unseen is new."""

    items: str = ""  # dotted path to the list in the body; "" = the body itself is the list
    id: str = Field(min_length=1)  # dotted path, inside an item, to its identity

    @field_validator("items")
    @classmethod
    def _items_path(cls, value: str) -> str:
        if value and not _DOTTED_PATH.match(value):
            raise ValueError(f"{value!r} is not a dotted path (e.g. data.items), nor \"\"")
        return value

    @field_validator("id")
    @classmethod
    def _id_path(cls, value: str) -> str:
        if not _DOTTED_PATH.match(value):
            raise ValueError(f"{value!r} is not a field name or dotted path (e.g. id)")
        return value


def _new_shape(value: object) -> object:
    if value == "changed" or isinstance(value, PollItems):
        return value
    if isinstance(value, dict):
        # Validated here so that a bad object is reported once, by its own key, rather than
        # once per member of the union.
        try:
            return PollItems.model_validate(value)
        except ValidationError as exc:
            raise ValueError("; ".join(
                f"{'.'.join(str(part) for part in error['loc'])}:"
                f" {str(error['msg']).removeprefix('Value error, ')}"
                for error in exc.errors()
            )) from None
    raise ValueError('expected "changed" or {"items": "<dotted.path>", "id": "<field>"}')


NewRule = Annotated[Literal["changed"] | PollItems, BeforeValidator(_new_shape)]


class PollerConfig(_Section):
    """An outbound poll: a URL (httpx) or an argv command, what counts as new, and a job."""

    url: str | None = None
    command: list[str] | None = None
    interval_s: float = Field(default=300.0, ge=0.05, le=86400)
    timeout_s: float = Field(default=20.0, gt=0, le=600)
    headers_env: dict[str, str] = Field(default={})  # header name -> env var name
    new: NewRule = "changed"
    job: WakeJob
    max_body_bytes: int = Field(default=5_000_000, ge=1024, le=25_000_000)
    alert_after_failures: int = Field(default=3, ge=1, le=1000)
    max_backoff_s: float = Field(default=3600.0, gt=0, le=7 * 86400)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, _, rest = value.partition("://")
        host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        if scheme.lower() not in ("http", "https") or not host:
            raise ValueError("expected an http:// or https:// URL with a host")
        return value

    @field_validator("command")
    @classmethod
    def _argv(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(value)):
            raise ValueError("expected an argv list of non-empty strings, e.g. [\"gh\", \"api\"]")
        return value

    @field_validator("headers_env")
    @classmethod
    def _header_names(cls, value: dict[str, str]) -> dict[str, str]:
        for header, env in value.items():
            if not _HEADER_NAME.match(header):
                raise ValueError(f"{header!r} is not an HTTP header name")
            if header.lower() in _CONDITIONAL_HEADERS:
                raise ValueError(f"{header} is sent by the poller itself, from its cursor")
            if not _ENV_NAME.match(env):
                raise ValueError(f"{env!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.url is None) == (self.command is None):
            raise ValueError("give exactly one of url (an HTTP poll) or command (an argv poll)")
        if self.command is not None and self.headers_env:
            raise ValueError("headers_env applies to url pollers only")
        if self.max_backoff_s < self.interval_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) is shorter than"
                             f" interval_s ({self.interval_s})")
        return self


class WakesConfig(_Section):
    """How wakes that cannot start now are retried, and when they are given up; how late a
    schedule missed while the daemon was down may still fire."""

    max_attempts: int = Field(default=5, ge=1, le=100)
    retry_first_s: float = Field(default=30.0, gt=0)
    retry_max_s: float = Field(default=900.0, gt=0)
    keep_deliveries_days: int = Field(default=7, ge=3, le=90)
    shutdown_grace_s: float = Field(default=20.0, gt=0, le=600)
    missed_fire_grace_s: int = Field(default=3600, ge=60, le=86400)


class SlackConfig(_Section):
    """Slack over Socket Mode: tokens come from the environment, never from this file."""

    bot_token_env: str = "SLACK_BOT_TOKEN"
    app_token_env: str = "SLACK_APP_TOKEN"
    api_url: str | None = None  # the Web API base URL; only tests point it elsewhere
    allowed_users: list[str] = Field(default=[])  # Slack user ids (U…)
    alert_channel: str | None = None
    profile: str | None = None  # what chat runs may use; its question_hold_seconds applies
    # Heard nothing (no event, no answered ping) this long: reconnect (bothy/chat/liveness.py).
    # Bothy pings every quarter of it (at most every 5 s).
    silent_after_s: float = Field(default=120.0, ge=2, le=3600)


class DiscordConfig(_Section):
    """Discord over the gateway: the token comes from the environment."""

    token_env: str = "DISCORD_BOT_TOKEN"
    api_url: str | None = None  # the REST base URL of one-shot posts; only tests point it elsewhere
    message_content_intent: bool = True  # needed to read replies that do not mention the bot
    allowed_users: list[str] = Field(default=[])  # Discord user ids
    alert_channel: str | None = None
    profile: str | None = None  # what chat runs may use; its question_hold_seconds applies
    # Heard nothing (no event, no heartbeat ACK) this long: reconnect. Keep it well above
    # Discord's heartbeat interval (about 41 s).
    silent_after_s: float = Field(default=120.0, ge=2, le=3600)


class ChatConfig(_Section):
    """The chat connections `bothy serve` keeps; either, both or none."""

    slack: SlackConfig | None = None
    discord: DiscordConfig | None = None
    alert_timeout_s: float = Field(default=10.0, gt=0, le=120)  # a command's one-shot alert post


class OtelConfig(_Section):
    """Where ``bothy serve`` sends every finished run's trace (OTLP/HTTP, JSON), and how hard
    it tries (bothy/traceexport.py)."""

    endpoint: str  # the full address to POST to, e.g. http://collector:4318/v1/traces
    headers_env: dict[str, str] = Field(default={})  # header name -> env var name
    include_content: bool = False  # questions, commands, reasons: held back unless true
    timeout_s: float = Field(default=10.0, gt=0, le=60)
    max_attempts: int = Field(default=20, ge=1, le=1000)
    retry_first_s: float = Field(default=5.0, gt=0, le=3600)
    retry_max_s: float = Field(default=600.0, gt=0, le=86400)

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str) -> str:
        scheme, _, rest = value.partition("://")
        host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        if scheme.lower() not in ("http", "https") or not host:
            raise ValueError("expected the http:// or https:// address to POST traces to,"
                             " e.g. http://collector:4318/v1/traces")
        return value

    @field_validator("headers_env")
    @classmethod
    def _header_names(cls, value: dict[str, str]) -> dict[str, str]:
        for header, env in value.items():
            if not _HEADER_NAME.match(header):
                raise ValueError(f"{header!r} is not an HTTP header name")
            if header.lower() == "content-type":
                raise ValueError("Content-Type is application/json: the exporter sets it")
            if not _ENV_NAME.match(env):
                raise ValueError(f"{env!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _retries_in_order(self) -> Self:
        if self.retry_max_s < self.retry_first_s:
            raise ValueError(f"retry_max_s ({self.retry_max_s}) is shorter than"
                             f" retry_first_s ({self.retry_first_s})")
        return self


class Config(_Section):
    """The whole configuration of one Bothy site."""

    site: str
    workspace: Path
    pool: PoolConfig = Field(default_factory=PoolConfig)
    budget: BudgetConfig
    codex: CodexConfig = Field(default_factory=CodexConfig)
    cairn: CairnConfig = Field(default_factory=CairnConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    profiles: dict[str, ProfileConfig] = Field(default={})
    listen: ListenConfig = Field(default_factory=ListenConfig)
    webhooks: dict[str, WebhookRoute] = Field(default={})
    pollers: dict[str, PollerConfig] = Field(default={})
    wakes: WakesConfig = Field(default_factory=WakesConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    secrets_file: Path | None = None  # 0600 NAME=value file read when a variable is not set
    otel: OtelConfig | None = None  # off unless set: bothy serve exports nothing
    web: WebConfig = Field(default_factory=WebConfig)

    @field_validator("site")
    @classmethod
    def _site_name(cls, value: str) -> str:
        if not _SITE_NAME.match(value):
            raise ValueError("expected a short name of letters, digits, '.', '_' or '-'")
        return value

    @field_validator("pollers")
    @classmethod
    def _poller_profiles_exist(
        cls, pollers: dict[str, PollerConfig], info: ValidationInfo
    ) -> dict[str, PollerConfig]:
        profiles = info.data.get("profiles")  # None if invalid: that is reported already
        for name, poller in pollers.items():
            if not _SITE_NAME.match(name):
                raise ValueError(f"poller name {name!r}: expected a short name of letters,"
                                 " digits, '.', '_' or '-'")
            if profiles is None or poller.job.profile is None:
                continue
            if poller.job.profile not in profiles:
                defined = ", ".join(sorted(profiles)) or "none"
                raise ValueError(f"pollers.{name}.job.profile {poller.job.profile!r} is not"
                                 f" defined in profiles (defined: {defined})")
        return pollers

    @field_validator("secrets_file")
    @classmethod
    def _secrets_file_absolute(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        value = value.expanduser()
        if not value.is_absolute():
            raise ValueError("expected an absolute path, e.g. \"/home/me/.bothy/service.env\"")
        return value

    # The rules that span sections, one validator each, run in this order.

    @model_validator(mode="after")
    def _wall_clock_within_expiry(self) -> Self:
        if self.limits.wall_clock_s >= self.budget.reservation_expiry_s:
            raise ValueError(
                f"limits.wall_clock_s ({self.limits.wall_clock_s}) must be shorter than "
                f"budget.reservation_expiry_s ({self.budget.reservation_expiry_s}), or a live "
                "run's reservation could expire under it"
            )
        return self

    @model_validator(mode="after")
    def _webhook_routes_agree(self) -> Self:
        """Paths unique, public routes with a public port, job profiles defined."""
        paths: dict[str, str] = {}
        for name, route in self.webhooks.items():
            if route.path in paths:
                raise ValueError(f"webhooks.{name}.path {route.path!r} is also the path of"
                                 f" webhooks.{paths[route.path]}")
            paths[route.path] = name
            if route.public and self.listen.public_port is None:
                raise ValueError(f"webhooks.{name} is public but listen.public_port is not set")
            for job in route.jobs:
                if job.profile is not None and job.profile not in self.profiles:
                    raise ValueError(f"webhooks.{name}: job profile {job.profile!r} is not"
                                     " defined in profiles")
        return self

    @model_validator(mode="after")
    def _reports_go_to_configured_chat(self) -> Self:
        """A job's ``report_to`` names a chat platform this site has configured."""
        jobs = [(f"webhooks.{name}.jobs.{index}.report_to", job.report_to)
                for name, route in self.webhooks.items() for index, job in enumerate(route.jobs)]
        jobs += [(f"pollers.{name}.job.report_to", poller.job.report_to)
                 for name, poller in self.pollers.items()]
        for key, target in jobs:
            if target is not None and (problem := report_to_problem(target, self.chat)):
                raise ValueError(f"{key}: {problem}")
        return self

    @model_validator(mode="after")
    def _chat_profiles_defined(self) -> Self:
        for platform, section in (("slack", self.chat.slack), ("discord", self.chat.discord)):
            if section is not None and section.profile not in (None, *self.profiles):
                raise ValueError(f"chat.{platform}.profile {section.profile!r} is not defined"
                                 " in profiles")
        return self

    @model_validator(mode="after")
    def _held_questions_within_expiry(self) -> Self:
        for name, profile in self.profiles.items():
            held = self.limits.wall_clock_s + profile.question_hold_seconds
            if held >= self.budget.reservation_expiry_s:
                raise ValueError(
                    f"profiles.{name}.question_hold_seconds ({profile.question_hold_seconds}) plus"
                    f" limits.wall_clock_s must stay below budget.reservation_expiry_s"
                    f" ({self.budget.reservation_expiry_s})"
                )
        return self


def load_config(path: Path) -> Config:
    """Read and validate ``path``; raise ConfigError saying what is wrong and where."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist: create it (see docs/CONFIGURATION.md for "
            'a minimal example: {"site": ..., "workspace": ..., "budget": {...}})',
            path=path,
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}", path=path) from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}",
            path=path,
        ) from exc
    return parse_config(raw, path=path)


def parse_config(raw: object, *, path: Path) -> Config:
    """Validate an already-decoded config value."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a JSON object, not {type(raw).__name__}", path=path
        )
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise _explain(exc, path) from None


def _explain(exc: ValidationError, path: Path) -> ConfigError:
    """Turn pydantic's report into one message per problem, each naming its key."""
    lines = []
    first_key: str | None = None
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(top level)"
        first_key = first_key or key
        if error["type"] == "extra_forbidden":
            allowed = _allowed_keys(error["loc"][:-1])
            detail = f"unknown key (allowed here: {', '.join(allowed)})"
        elif error["type"] == "missing":
            detail = "required key is missing"
        elif error["type"] == _SECRET_INLINE:  # never echo the value back
            detail = str(error["msg"])
        else:
            message = str(error["msg"]).removeprefix("Value error, ")
            got = repr(error.get("input"))
            detail = f"{message} (got {got if len(got) <= 80 else got[:77] + '...'})"
        lines.append(f"  {key}: {detail}")
    count = len(lines)
    head = f"config file {path} has {count} problem{'s' if count > 1 else ''}:"
    return ConfigError("\n".join([head, *lines]), path=path, key=first_key)


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            return ["(see docs/CONFIGURATION.md)"]
    return sorted(model.model_fields)
