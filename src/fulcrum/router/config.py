"""Router configuration: pools of workers, the policy of each, shape rules and fault settings.

One tree of frozen dataclasses with every default here, read from ``--worker``/``--policy`` flags
or from a YAML/JSON file::

    policy: shape                 # round_robin | least_load | cache_aware | shape
    api_key: ROUTER_KEY           # clients send 'Authorization: Bearer ROUTER_KEY'
    pools:
      rag:   {policy: cache_aware, workers: [{url: "http://h1:8000", api_key: K1}]}
      batch: {policy: least_load,  workers: ["http://h2:8000"]}
    rules:                        # first match wins; a request matching none goes to default_pool
      - {pool: batch, min_output_tokens: 512}
      - {pool: rag, min_prefix_count: 4}
    default_pool: rag
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

POLICIES = ("round_robin", "least_load", "cache_aware", "shape")
INNER_POLICIES = ("round_robin", "least_load", "cache_aware")


class ConfigError(ValueError):
    """A bad router configuration; the message names the offending key."""


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    api_key: str | None = None  # sent upstream as 'Authorization: Bearer ...'


@dataclass(frozen=True)
class PoolSpec:
    name: str
    policy: str = "round_robin"
    workers: tuple[WorkerSpec, ...] = ()


@dataclass(frozen=True)
class ShapeRule:
    """A request matches when every condition that is set holds (``None`` = any).

    Prompt lengths are estimated tokens (characters / 4): the router does not tokenize."""

    pool: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_output_tokens: int | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    min_prefix_count: int | None = None  # requests seen so far with the same leading text
    header: str | None = None  # e.g. "x-tenant"; with header_value, that value, else present
    header_value: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    pools: tuple[PoolSpec, ...]
    policy: str = "round_robin"
    rules: tuple[ShapeRule, ...] = ()
    default_pool: str = "default"
    api_key: str | None = None
    # faults
    max_retries: int = 2  # extra workers tried when one fails before the first byte
    retry_backoff_s: float = 0.05  # doubled after each failed attempt
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 2.0  # /health and /metrics of every worker
    breaker_failures: int = 3  # consecutive failures that open a worker's breaker
    breaker_cooldown_s: float = 5.0  # before an open breaker lets one probe through
    # cache_aware (SGLang router's defaults)
    cache_threshold: float = 0.5  # matched fraction above which the prefix decides
    balance_abs_threshold: int = 32  # in-flight spread beyond which the least loaded wins...
    balance_rel_threshold: float = 1.5  # ...when also max > rel x min
    cache_block_chars: int = 32  # granularity of the approximate prefix trees
    cache_max_chars: int = 4_000_000  # per worker tree, evicted least recently used first
    prefix_chars: int = 256  # leading text that names a request's prefix group (shape rules)

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise ConfigError(f"no pool named {name!r}")


def _worker(item: Any, where: str) -> WorkerSpec:
    if isinstance(item, str):
        return WorkerSpec(url=_url(item, where))
    if isinstance(item, dict) and "url" in item:
        unknown = set(item) - {"url", "api_key"}
        if unknown:
            raise ConfigError(f"{where}: unknown worker key(s) {sorted(unknown)}")
        return WorkerSpec(url=_url(item["url"], where), api_key=item.get("api_key"))
    raise ConfigError(f"{where}: a worker is a URL or {{url: ..., api_key: ...}}, got {item!r}")


def _url(url: Any, where: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: worker url must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def _policy(name: Any, where: str, allowed: tuple[str, ...]) -> str:
    if name not in allowed:
        raise ConfigError(f"{where}: policy must be one of {list(allowed)}, got {name!r}")
    return str(name)


def _rule(item: Any, i: int, pools: set[str]) -> ShapeRule:
    where = f"rules[{i}]"
    if not isinstance(item, dict) or "pool" not in item:
        raise ConfigError(f"{where}: a rule is a mapping with a 'pool'")
    names = {f.name: f for f in fields(ShapeRule)}
    unknown = set(item) - set(names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    if item["pool"] not in pools:
        raise ConfigError(f"{where}.pool: no pool named {item['pool']!r}")
    for k, v in item.items():
        if k.startswith(("min_", "max_")) and (not isinstance(v, int) or v < 0):
            raise ConfigError(f"{where}.{k}: must be a non-negative integer, got {v!r}")
    if "stream" in item and not isinstance(item["stream"], bool):
        raise ConfigError(f"{where}.stream: must be true or false")
    return ShapeRule(**item)


def parse_config(data: dict[str, Any], **overrides: Any) -> RouterConfig:
    """Build a ``RouterConfig`` from a mapping (a parsed YAML/JSON file); ``overrides`` that are
    not ``None`` replace top-level keys (command-line flags win over the file)."""
    if not isinstance(data, dict):
        raise ConfigError("the router config must be a mapping")
    data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    top = {f.name for f in fields(RouterConfig)}
    unknown = set(data) - top - {"workers"}
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}")
    policy = _policy(data.get("policy", "round_robin"), "policy", POLICIES)
    raw_pools = data.get("pools")
    if raw_pools is None:  # the short form: one pool of workers under the top-level policy
        if policy == "shape":
            raise ConfigError("policy: 'shape' needs pools")
        raw_pools = {"default": {"policy": policy, "workers": data.get("workers", [])}}
    elif "workers" in data:
        raise ConfigError("give either 'workers' (one pool) or 'pools', not both")
    if not isinstance(raw_pools, dict) or not raw_pools:
        raise ConfigError("pools: a non-empty mapping of pool name to {policy, workers}")
    pools = []
    for name, spec in raw_pools.items():
        where = f"pools.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: a mapping with 'policy' and 'workers'")
        unknown = set(spec) - {"policy", "workers"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        inner = _policy(spec.get("policy", "round_robin"), f"{where}.policy", INNER_POLICIES)
        ws = spec.get("workers", [])
        if not isinstance(ws, list):
            raise ConfigError(f"{where}.workers: a list")
        workers = tuple(_worker(w, f"{where}.workers[{j}]") for j, w in enumerate(ws))
        pools.append(PoolSpec(name=str(name), policy=inner, workers=workers))
    names = {p.name for p in pools}
    rules = data.get("rules", [])
    if not isinstance(rules, list):
        raise ConfigError("rules: a list")
    if rules and policy != "shape":
        raise ConfigError("rules apply only with policy: shape")
    default_pool = data.get("default_pool", pools[0].name)
    if default_pool not in names:
        raise ConfigError(f"default_pool: no pool named {default_pool!r}")
    rest = {k: v for k, v in data.items() if k in top and k not in ("pools", "rules", "policy")}
    rest.pop("default_pool", None)
    for f in fields(RouterConfig):
        if f.name in rest and f.name != "api_key":
            v = rest[f.name]
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{f.name}: must be a non-negative number, got {v!r}")
            rest[f.name] = int(v) if f.type == "int" else float(v)
    return RouterConfig(
        pools=tuple(pools),
        policy=policy,
        rules=tuple(_rule(r, i, names) for i, r in enumerate(rules)),
        default_pool=default_pool,
        **rest,
    )


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON file into a mapping."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError
        kind = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise ConfigError(f"{path}: not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data
