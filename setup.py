"""Package discovery for the three source folders that make one `edgeinfer` namespace.

`edgeinfer/` is the package itself; `runtimes/` and `converters/` sit beside it at the top of
the repository (the product's layout) and are installed as `edgeinfer.runtimes` and
`edgeinfer.converters` through `package-dir` in pyproject.toml. Every package under each folder
is found here, never listed by hand, so a new subpackage cannot be left out of the wheel.
Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

# folder in the repository -> the import name it is installed under
ROOTS = {
    "edgeinfer": "edgeinfer",
    "runtimes": "edgeinfer.runtimes",
    "converters": "edgeinfer.converters",
}


def discovered() -> list[str]:
    packages = []
    for folder, name in ROOTS.items():
        packages.append(name)
        packages += [f"{name}.{found}" for found in find_packages(folder)]
    # edgeinfer/ itself holds no folder named runtimes or converters, so nothing is found twice
    return sorted(set(packages))


setup(packages=discovered())
