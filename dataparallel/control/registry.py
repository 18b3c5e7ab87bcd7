"""URL schemes -> channel classes.

Built-in and third-party transports register the same way: through the entry-point group
``dataparallel.transports`` (``scheme = "module:Class"``), read lazily on first use.
:func:`register_transport` adds or overrides one at run time (a class, or a
``"module:Class"`` string imported only when the scheme is used).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from ..errors import ConfigError
from .nativelog import quiet_grpc_log

if TYPE_CHECKING:
    from .channel import ControlChannel

ENTRY_POINT_GROUP = "dataparallel.transports"

# Which distribution to install when a built-in transport's library is missing.
_INSTALL_HINTS = {
    "zmq": "pip install pyzmq (a dependency of dataparallel itself: reinstall it)",
    "grpc": "pip install 'dataparallel[grpc]'",
    "etcd": "pip install 'dataparallel[etcd]'",
}

#: The words that make a URL option's value secret wherever they occur in its name
#: (``password=``, etcd's; ``key=``, a private key's file; ``api_token=``...): every message,
#: log line, report and ``repr`` shows such a value as ``***`` (:func:`mask_url`).
SECRET_WORDS = ("password", "passwd", "secret", "token", "key", "credential")
MASK = "***"


def is_secret_option(name: str) -> bool:
    """Whether URL option ``name``'s value is never shown (see :data:`SECRET_WORDS`)."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def mask_url(url: str) -> str:
    """``url`` as every message, log line and report shows it: the value of each secret
    option (:func:`is_secret_option`, its name read as a URL decodes it) and a password
    before ``@`` replaced by ``***``. Any text is taken, a malformed URL too (the message
    about it must not show what it hides). The one masking of URLs: everything that shows
    one calls it (or :attr:`ChannelURL.shown`)."""
    # scheme://user:PASSWORD@host, to the last @ before the query: a password may hold a '/'.
    url = re.sub(r"(?<=://)([^/?@:]*):[^?]*@", rf"\1:{MASK}@", url)
    head, sep, query = url.partition("?")
    if not sep:
        return url
    items = []  # to the end: a channel URL has no fragment, and a '#' may be a secret's
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        items.append(f"{name}={MASK}" if eq and is_secret_option(unquote_plus(name)) else item)
    return f"{head}?{'&'.join(items)}"


_lock = threading.Lock()
_registry: dict[str, type[ControlChannel] | str] = {}
_entry_points_loaded = False


@dataclass(frozen=True, repr=False)
class ChannelURL:
    """A parsed channel URL: ``scheme://[HOST[:PORT][,HOST[:PORT]...]][/PATH][?OPTIONS]``.

    ``memory://NAME`` puts NAME in ``hosts`` with no port; ``fsdir:///srv/job`` has no host
    (``hosts`` is empty) and the ``path`` ``/srv/job``. ``path`` is the path as given, leading
    ``/`` included, or ``""`` when there is none (or only ``/``). Which parts a scheme takes
    is its transport's to say (:attr:`ControlChannel.URL_FORM`,
    :attr:`ControlChannel.URL_HOST`); parsing only splits.
    """

    raw: str
    scheme: str
    hosts: tuple[tuple[str, int | None], ...]
    path: str = ""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        """The first host, ``""`` when the URL names none."""
        return self.hosts[0][0] if self.hosts else ""

    @property
    def port(self) -> int | None:
        return self.hosts[0][1] if self.hosts else None

    @property
    def shown(self) -> str:
        """``raw`` for messages and logs, its secrets masked (:func:`mask_url`)."""
        return mask_url(self.raw)

    def __repr__(self) -> str:
        return f"ChannelURL({self.shown!r})"

    def require_port(self) -> int:
        if self.port is None:
            raise ConfigError(f"{self.shown!r}: a port is required ({self.scheme}://HOST:PORT)")
        return self.port

    def flag(self, name: str) -> bool:
        """A yes/no option: ``1``/``true``/``yes`` or ``0``/``false``/``no``; absent is no."""
        value = self.options.get(name, "0").lower()
        if value not in _FLAGS:
            raise ConfigError(f"{self.shown!r}: option {name} must be 1 or 0, got {value!r}")
        return _FLAGS[value]

    def seconds(self, name: str, default: float) -> float:
        """A duration option, in seconds > 0."""
        text = self.options.get(name)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ConfigError(f"{self.shown!r}: option {name}={text!r} must be a number of seconds > 0")
        return value

    def file(self, name: str) -> bytes | None:
        """The contents of the file an option names (certificates, keys), None if absent."""
        path = self.options.get(name)
        if path is None:
            return None
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as err:
            given = MASK if is_secret_option(name) else repr(path)
            raise ConfigError(f"{self.shown!r}: cannot read {name}={given}: {err.strerror or err}") from None

    def certificate_files(self) -> None:
        """``cert=`` and ``key=`` come together, and ``ca=``, ``cert=``, ``key=`` are readable."""
        if ("cert" in self.options) != ("key" in self.options):
            raise ConfigError(f"{self.shown!r}: cert= and key= go together (a certificate and its private key)")
        for name in ("ca", "cert", "key"):
            self.file(name)

    def needs(self, wanted: str, *names: str) -> None:
        """Options ``names`` mean nothing unless ``wanted`` is given: a URL with them and
        without it would quietly do less than it says (e.g. certificates, but no TLS)."""
        given = [name for name in names if name in self.options]
        if given and not self.flag(wanted):
            raise ConfigError(
                f"{self.shown!r}: {', '.join(f'{n}=' for n in given)} {'takes' if len(given) == 1 else 'take'} effect "
                f"only with {wanted}=1: add {wanted}=1 "
                f"(or drop {', '.join(given)})"
            )


_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_url(url: str, form: str | None = None) -> ChannelURL:
    """Split a channel URL; raise :class:`ConfigError` naming what is wrong (and ``form``,
    the URL's expected shape, when the caller knows its transport)."""
    scheme = url_scheme(url)
    expected = f" (expected {form})" if form else ""
    parts = urlsplit(url)
    if "@" in url.partition("?")[0]:
        raise ConfigError(
            f"{mask_url(url)!r}: no USER@ or USER:PASSWORD@ in a channel URL: credentials are options "
            f"(etcd: ?user=NAME&password=SECRET){expected}"
        )
    hosts = tuple(_split_host_port(url, item, expected) for item in parts.netloc.split(",")) if parts.netloc else ()
    options: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key in options:
            raise ConfigError(f"{mask_url(url)!r}: option {key!r} given twice")
        options[key] = value
    path = parts.path if parts.path.strip("/") else ""
    return ChannelURL(url, scheme, hosts, path, options)


def url_scheme(url: str) -> str:
    """The scheme of a channel URL (lower case); :class:`ConfigError` if it is none."""
    scheme = urlsplit(url).scheme if isinstance(url, str) and "://" in url else ""
    if not scheme:
        raise ConfigError(
            f"not a channel URL: {mask_url(url) if isinstance(url, str) else url!r}; expected SCHEME://..., "
            f"known schemes: {', '.join(known_schemes())}"
        )
    return scheme.lower()


def resolve(
    url: str, token: str | None = None, *, serving: bool = False, where: str | None = None
) -> tuple[ChannelURL, type[ControlChannel]]:
    """The one way in for every entry point (``connect``, ``serve``, ``check``, ``launch``, the
    torchrun backends): parse ``url``, find its transport and validate its options
    (:meth:`ControlChannel.check_url`). A :class:`ConfigError` names ``where`` the URL came
    from (``DP_URL``, ``--url``, the TOML file) when given."""
    parsed, cls = locate(url, where)
    with _naming(where):
        cls.check_url(parsed, token, serving=serving)
    return parsed, cls


def locate(url: str, where: str | None = None) -> tuple[ChannelURL, type[ControlChannel]]:
    """Parse ``url`` and find its transport (its options unchecked: see :func:`resolve`); a
    malformed URL's message shows the transport's URL form and ``where`` it came from."""
    with _naming(where):
        scheme = url_scheme(url)
        cls = transport_class(scheme)
        return parse_url(url, cls.URL_FORM.format(scheme=scheme)), cls


@contextmanager
def _naming(where: str | None) -> Iterator[None]:
    """A :class:`ConfigError` raised inside says ``where`` the URL came from, when known."""
    try:
        yield
    except ConfigError as err:
        if where is None:
            raise
        raise ConfigError(f"{where}: {err}") from None


def _split_host_port(url: str, item: str, expected: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif item.count(":") == 1:
        host, port_text = item.split(":")
    else:
        host, port_text = item, ""
    if not host:
        raise ConfigError(f"{mask_url(url)!r}: empty host in {item!r}{expected}")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{mask_url(url)!r}: bad port {port_text!r} (an integer 0..65535){expected}")
    return host, int(port_text)


def register_transport(scheme: str, cls: type[ControlChannel] | str, *, replace: bool = False) -> None:
    """Register ``cls`` (a class or a ``"module:Class"`` string) for ``scheme``.

    A scheme already registered to something else (a built-in, an installed entry point, an
    earlier call) is refused with :class:`ConfigError` unless ``replace=True``; registering
    the same target again is harmless."""
    if not scheme.isidentifier() and not scheme.replace("-", "").replace("+", "").isalnum():
        raise ConfigError(f"bad scheme name {scheme!r}")
    with _lock:
        _load_entry_points_locked()
        current = _registry.get(scheme.lower())
        if current is not None and not replace and _target_name(current) != _target_name(cls):
            raise ConfigError(
                f"transport scheme {scheme!r} is already registered to {_target_name(current)}; "
                "pass replace=True to replace it"
            )
        _registry[scheme.lower()] = cls


def _target_name(target: type[ControlChannel] | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def known_schemes() -> list[str]:
    """The URL schemes that name a transport here: the bundled ones, those installed
    packages register (the ``dataparallel.transports`` entry point) and those given to
    :func:`register_transport`, sorted."""
    with _lock:
        _load_entry_points_locked()
        return sorted(_registry)


def transport_class(scheme: str) -> type[ControlChannel]:
    """The channel class for ``scheme``, importing it if needed."""
    with _lock:
        _load_entry_points_locked()
        target = _registry.get(scheme.lower())
    if target is None:
        raise ConfigError(
            f"unknown transport scheme {scheme!r}; known schemes: {', '.join(known_schemes())}. "
            f"Third-party transports register under the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    if isinstance(target, str):
        target = _import_target(scheme, target)
        with _lock:
            _registry[scheme.lower()] = target
    return target


def _import_target(scheme: str, target: str) -> type[ControlChannel]:
    """Import ``"module:Class"``. A :class:`ConfigError` names the file the module came from
    when it is not what the entry point meant (a local file or folder of the same name
    shadowing the installed package is the usual cause)."""
    module_name, _, attr = target.partition(":")
    quiet_grpc_log()  # before a transport's library (gRPC under grpc and etcd) is first imported
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        if missing == module_name or module_name.startswith(missing + "."):
            # A part of the module's own name: absent, or its parent came from elsewhere.
            hint = _INSTALL_HINTS.get(scheme, f"install the package that provides {module_name!r}")
            parent, _, last = missing.rpartition(".")
            origin = _origin(parent) if parent else None
            found = f" ({parent!r} was imported from {origin}, which has no submodule {last!r})" if origin else ""
        else:  # something the module itself imports
            hint = _INSTALL_HINTS.get(scheme, f"install the package that provides {missing!r}")
            origin = _origin(module_name)
            found = f" (imported by {module_name!r} from {origin})" if origin else ""
        raise ConfigError(
            f"transport {scheme!r} needs the module {missing!r}, which is not installed{found}; {hint}"
        ) from err
    except Exception as err:
        origin = _origin(module_name)
        source = f" from {origin}" if origin else ""
        raise ConfigError(
            f"transport {scheme!r}: importing {module_name!r}{source} failed: {type(err).__name__}: {err}"
        ) from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        origin = _origin(module_name)
        source = f"; it was imported from {origin}" if origin else ""
        raise ConfigError(
            f"transport {scheme!r}: module {module_name!r} has no attribute {attr!r}{source} "
            "(a local file or folder of that name shadowing the installed package?)"
        ) from err


def _origin(name: str) -> str | None:
    """Where module ``name`` was (or would be) imported from, for messages: its file, or the
    folders of a namespace package; None when that cannot be told."""
    module = sys.modules.get(name)
    if module is not None:
        file = getattr(module, "__file__", None)
        folders = list(getattr(module, "__path__", None) or [])
    else:
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # a parent package that fails to import
            return None
        if spec is None:
            return None
        file = spec.origin if spec.has_location else None
        folders = list(spec.submodule_search_locations or [])
    if file:
        return file
    if folders:
        return f"a folder with no __init__.py (a namespace package): {', '.join(folders)}"
    return None


def _load_entry_points_locked() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        # A run-time registration wins over an installed entry point of the same name.
        _registry.setdefault(ep.name.lower(), ep.value)
