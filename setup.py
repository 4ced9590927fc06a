"""The package's file list (everything else is in pyproject.toml): the library under src/, the config tree conf/
shipped inside it as ``adazeta/conf`` (each folder of it a data package, so that setuptools copies every YAML), and
the published numbers results/paper_numbers.csv as ``adazeta/reference``, so that an installed package (a wheel,
``pip install .``) runs and makes its tables without a checkout. In a checkout, ``adazeta.paths.config_dir`` reads
conf/ in place."""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
CONF = ["adazeta.conf", *sorted("adazeta.conf." + ".".join(p.relative_to(HERE / "conf").parts)
                                for p in (HERE / "conf").rglob("*") if p.is_dir() and any(p.glob("*.yaml")))]



class FreshBuild(build_py):
    """Builds the package afresh: a module moved or removed since an earlier build of this checkout is not shipped
    from the build folder it was left in (setuptools copies into ``build/lib`` and never deletes)."""

    def run(self) -> None:
        shutil.rmtree(Path(self.build_lib) / "adazeta", ignore_errors=True)
        super().run()


setup(
    cmdclass={"build_py": FreshBuild},
    packages=[*find_packages("src"), *CONF, "adazeta.reference"],
    package_dir={"": "src", "adazeta.conf": "conf", "adazeta.reference": "results"},
    package_data={"adazeta": ["py.typed"], **{name: ["*.yaml"] for name in CONF},
                  "adazeta.reference": ["paper_numbers.csv"]},
)
