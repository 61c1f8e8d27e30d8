"""Installs, from folders of carried wheels, those whose distribution this (offline) machine lacks, into /tmp/site
(pip --no-index --no-deps --target); a distribution already in /tmp/site is not installed again.

    python3 benchmarks/install_wheels.py DIR [DIR ...]      # then PYTHONPATH=/tmp/site:...
"""

import importlib.metadata as md
import pathlib
import subprocess
import sys

SITE = pathlib.Path("/tmp/site")


def have(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return any(SITE.glob(f"{dist}-*.dist-info"))


def main(folders: list[str]) -> None:
    wheels = {w.name.split("-")[0]: w for d in folders for w in sorted(pathlib.Path(d).glob("*.whl"))}
    need = [str(w) for name, w in wheels.items() if not have(name)]
    print(f"wheels: {len(wheels)} carried, installing {[pathlib.Path(w).name.split('-')[0] for w in need]}")
    if need:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(SITE),
                        *need], check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
