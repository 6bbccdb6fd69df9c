"""Tenants: who a request comes from, and which prefix-cache namespace it reads and fills.

A tenant is a named API key. `--api-key KEY` makes one tenant named "default"; `--api-keys-file
PATH` adds one per line (`name key`). With no key at all the server is open: every request is
the same anonymous tenant. The name is for logs and the cache namespace, never a credential.

    server                         a request's cache namespace        the trace's divergence
    -----------------------------  ---------------------------------  --------------------------
    open, or one tenant            its cache_salt as sent             whole
    2+ tenants (the default)       the tenant + its cache_salt        whole (its own history)
    2+ tenants, shared cache       its cache_salt as sent; none:      without the cached token
                                   SHARED_CACHE_SALT (every tenant)   in SHARED_CACHE_SALT

The namespace is the cache_salt the engine sees (engine/radix_cache.py: a root per salt): what
one namespace cached is invisible to the others: no `cached_tokens`, no faster first token, nothing
in the trace (the pool, the batch and eviction stay shared: README, "Sharing a server").
A request's own cache_salt stays the vLLM meaning: whoever sends the same salt shares the
entries, so in the shared mode a salt is a private namespace for those who know it.

Keys are compared as sha256 digests, each against every key (hmac.compare_digest, no early
exit), so neither a key's bytes nor its length nor its position in the file shows in timing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from onecall.errors import InvalidParameterError

DEFAULT_TENANT = "default"  # the name --api-key's tenant goes by
# The namespace every tenant's unsalted requests share under --shared-prefix-cache. A salt like
# any other to the engine; the trace records its hash, and the server hides the cached token of a
# divergence read in it (serving_common.py): that path may be another tenant's prompt.
SHARED_CACHE_SALT = "onecall:shared-prefix-cache"
SHARED_CACHE_SALT_SHA256 = hashlib.sha256(SHARED_CACHE_SALT.encode()).hexdigest()[:12]  # as the trace has it

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str = field(repr=False)  # never printed


class Tenants:
    """The server's tenants: authentication and cache namespaces (the table above)."""

    def __init__(self, tenants: Sequence[Tenant], *, shared_prefix_cache: bool = False) -> None:
        problem = _problem(tenants)
        if problem is not None:
            raise InvalidParameterError("api_key", problem)
        self.tenants = tuple(tenants)
        self.shared_prefix_cache = shared_prefix_cache
        self._digests = [(t, _digest(t.key)) for t in tenants]

    @classmethod
    def build(
        cls, api_key: str | None, tenants: Sequence[Tenant] = (), *, shared_prefix_cache: bool = False
    ) -> Tenants:
        """--api-key (the tenant "default") and --api-keys-file's tenants together."""
        if api_key is not None:
            if not api_key.strip():
                raise InvalidParameterError(
                    "api_key", "is empty: give a key, or leave --api-key out for a server without one"
                )
            tenants = [Tenant(DEFAULT_TENANT, api_key), *tenants]
        return cls(tenants, shared_prefix_cache=shared_prefix_cache)

    @property
    def is_open(self) -> bool:
        """No key configured: every request is the one anonymous tenant."""
        return not self.tenants

    @property
    def is_shared(self) -> bool:
        """Several tenants read and fill one namespace (the unsalted requests')."""
        return self.shared_prefix_cache and len(self.tenants) > 1

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant whose key an `Authorization: Bearer KEY` header carries; None if none does."""
        scheme, _, given = authorization.partition(" ")
        digest = _digest(given.strip())
        found = None
        for tenant, key in self._digests:  # every key, whichever matches: the same time for all
            if hmac.compare_digest(digest, key):
                found = tenant
        return found if scheme.lower() == "bearer" and given.strip() else None

    def cache_salt(self, tenant: Tenant | None, salt: str | None) -> str | None:
        """The cache_salt the engine runs a request of `tenant` under (the module's table)."""
        if tenant is None or len(self.tenants) < 2:
            return salt  # an open server or a single tenant: nobody else to keep apart
        if self.shared_prefix_cache:
            return SHARED_CACHE_SALT if salt is None else salt
        # within SamplingParams' MAX_CACHE_SALT whatever the request's own salt; a tenant's name
        # and salt can never compose another tenant's namespace
        return "tenant:" + hashlib.sha256(json.dumps([tenant.name, salt]).encode()).hexdigest()

    @property
    def published_cache_salt(self) -> str | None:
        """The namespace KV events describe: the one unsalted requests share (kv_events.py)."""
        return SHARED_CACHE_SALT if self.is_shared else None


def load_keys_file(path: str | Path) -> list[Tenant]:
    """--api-keys-file: one tenant per line, `name key`; blank lines and `#` comments skipped.

    Refused, naming the line: a line that is not two fields, a name that is not [A-Za-z0-9_.@-]
    (up to 64), a key equal to its name, a name or a key given twice, an empty file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameterError("api_keys_file", f"cannot read {str(path)!r}: {e}") from None
    tenants: list[Tenant] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"{path}, line {number}"
        if len(fields) != 2:
            raise InvalidParameterError(
                "api_keys_file", f"{where}: expected 'name key' (two fields), got {len(fields)}"
            )
        name, key = fields
        if not _NAME.fullmatch(name):
            raise InvalidParameterError(
                "api_keys_file", f"{where}: the name {name!r} must be 1-64 of A-Z a-z 0-9 _ . @ -"
            )
        if key == name:
            raise InvalidParameterError("api_keys_file", f"{where}: the key of {name!r} is its name")
        tenants.append(Tenant(name, key))
        problem = _problem(tenants)
        if problem is not None:
            raise InvalidParameterError("api_keys_file", f"{where}: {problem}")
    if not tenants:
        raise InvalidParameterError("api_keys_file", f"{path} holds no 'name key' line")
    return tenants


def is_readable_by_others(path: str | Path) -> bool:
    """The keys file's group or others may read it (worth a warning: it holds every key)."""
    return bool(Path(path).stat().st_mode & (stat.S_IRGRP | stat.S_IROTH))


def _problem(tenants: Sequence[Tenant]) -> str | None:
    """What is wrong with these tenants together, or None."""
    names: set[str] = set()
    keys: set[str] = set()
    for t in tenants:
        if not t.key.strip():
            return f"the key of {t.name!r} is empty"
        if t.key != t.key.strip():
            return f"the key of {t.name!r} starts or ends with whitespace (no header could carry it)"
        if t.name in names:
            return f"the tenant name {t.name!r} is given twice"
        if t.key in keys:
            return f"the key of {t.name!r} is another tenant's too"
        names.add(t.name)
        keys.add(t.key)
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
