"""What starting a tool server would do, in words the user reads before saying yes.

A stdio server is a program that runs with the user's rights; an HTTP server receives
whatever the model sends it. Nothing starts until the user has seen, for each server, the
command, its arguments, its environment (variables that change how any program loads or
runs are called out), the URL, and which server of the same name it replaces.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from urllib.parse import urlsplit

from app.tools.server_config import ServerConfig

# Environment variables that make a program load or run other code than it says.
_RISKY_ENV = {
    "LD_PRELOAD": "loads a library into the program",
    "LD_LIBRARY_PATH": "changes which libraries the program loads",
    "LD_AUDIT": "loads a library into the program",
    "PYTHONPATH": "changes which Python code the program imports",
    "PYTHONSTARTUP": "runs a Python file first",
    "PYTHONHOME": "changes which Python runs",
    "NODE_OPTIONS": "can make Node.js load other code",
    "PATH": "changes which programs run by name",
    "BASH_ENV": "runs a shell file first",
    "ENV": "runs a shell file first",
    "PERL5OPT": "can make Perl load other code",
    "RUBYOPT": "can make Ruby load other code",
    "JAVA_TOOL_OPTIONS": "can make Java load other code",
}
_SHELLS = {"sh", "bash", "zsh", "dash", "fish", "ksh", "cmd", "cmd.exe", "powershell",
           "pwsh"}
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


@dataclass(frozen=True)
class ServerReview:
    """One server as the confirmation shows it: what it is, and what to look out for."""

    config: ServerConfig
    lines: tuple[str, ...]  # the command, arguments, environment or URL, one per line
    warnings: tuple[str, ...]  # what deserves a second look
    replaces: ServerConfig | None  # the saved server of the same name, if any

    @property
    def name(self) -> str:
        return self.config.name

    def text(self) -> str:
        """The whole review as plain text (the dialog shows it; tests read it)."""
        kind = "a program on this computer" if self.config.command else "a server at a URL"
        out = [f"{self.name} ({kind})"]
        out += [f"  {line}" for line in self.lines]
        out += [f"  ⚠ {warning}" for warning in self.warnings]
        return "\n".join(out)


def _env_warnings(config: ServerConfig) -> list[str]:
    warnings = []
    for key, _value in config.env:
        upper = key.upper()
        why = _RISKY_ENV.get(upper)
        if why is None and upper.startswith(("LD_", "DYLD_")):
            why = "changes how the program loads libraries"
        if why:
            warnings.append(f"environment {key} {why}")
    return warnings


def _command_warnings(config: ServerConfig) -> list[str]:
    warnings = []
    program = config.command.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if program in _SHELLS:
        warnings.append(f"runs a shell ({program}): the arguments are a script, not a "
                        "single program")
    if program in {"npx", "uvx", "pipx", "bunx"} or \
            (program in {"pnpm", "yarn", "npm"} and "dlx" in config.args[:2]):
        warnings.append(f"{program} downloads and runs a package from the internet")
    if shutil.which(config.command) is None:  # a path or a name looked up on PATH
        warnings.append(f"{config.command} is not found on this computer: it will fail "
                        "to start")
    return warnings


def _url_warnings(config: ServerConfig) -> list[str]:
    parts = urlsplit(config.url)
    host = (parts.hostname or "").lower()
    warnings = []
    if host not in _LOCAL_HOSTS:
        warnings.append(f"another computer ({host}) receives what the model sends to "
                        "this server's tools")
        if parts.scheme == "http":
            warnings.append("plain http: what is sent can be read on the way")
    return warnings


def _replacement(config: ServerConfig, old: ServerConfig) -> str:
    if (old.command, old.args, old.env, old.url) == \
            (config.command, config.args, config.env, config.url):
        return f"replaces the saved server {old.name}, which is the same"
    return f"replaces the saved server {old.name}: {old.where()}"


def review(config: ServerConfig, saved: list[ServerConfig]) -> ServerReview:
    """How ``config`` reads to the user, next to the ``saved`` servers it may replace."""
    old = next((s for s in saved if s.name == config.name), None)
    if config.url:
        lines = [f"URL: {config.url}"]
        warnings = _url_warnings(config)
    else:
        lines = [f"Command: {config.command}"]
        lines += [f"Argument: {arg}" for arg in config.args] or ["Arguments: none"]
        lines += [f"Environment: {key}={value}" for key, value in config.env]
        warnings = _command_warnings(config) + _env_warnings(config)
    if old is not None:
        warnings.append(_replacement(config, old))
    return ServerReview(config, tuple(lines), tuple(warnings), old)


def reviews(configs: list[ServerConfig], saved: list[ServerConfig]) -> list[ServerReview]:
    return [review(config, saved) for config in configs]
