"""The package's file list (everything else is in pyproject.toml): the library under src/, and the config tree
conf/ shipped inside it as ``adazeta/conf``, so that an installed package (a wheel, ``pip install .``) runs without
a checkout. In a checkout, ``adazeta.paths.config_dir`` reads conf/ in place."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages("src"), "adazeta.conf"],
    package_dir={"": "src", "adazeta.conf": "conf"},
    package_data={"adazeta": ["py.typed"], "adazeta.conf": ["*.yaml", "**/*.yaml"]},
)
