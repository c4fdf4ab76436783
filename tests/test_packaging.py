"""The installed package: one clean top-level name, kivi_jax."""

import pathlib
import re
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_installs_only_the_kivi_jax_namespace(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("kivi_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"kivi_jax", next(t for t in top if t.endswith(".dist-info"))}
    # Every package of the repository is in the wheel; models/ and pallas_kernels/ under kivi_jax.
    installed_as = {
        "kivi_jax": "kivi_jax",
        "models": "kivi_jax/models",
        "pallas_kernels": "kivi_jax/pallas_kernels",
    }
    for top_dir, target in installed_as.items():
        for init in (ROOT / top_dir).rglob("__init__.py"):
            relative = init.relative_to(ROOT / top_dir).as_posix()
            assert f"{target}/{relative}" in names, f"{top_dir}/{relative} is not packaged"


def test_repository_folders_import_under_kivi_jax():
    import kivi_jax.models
    import kivi_jax.pallas_kernels

    assert pathlib.Path(kivi_jax.models.__file__).parent.name == "models"
    assert pathlib.Path(kivi_jax.pallas_kernels.__file__).parent.name == "pallas_kernels"


def test_version_is_the_installed_distributions():
    import importlib.metadata
    import tomllib

    import kivi_jax

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert kivi_jax.__version__ == importlib.metadata.version("kivi-jax")
    assert kivi_jax.__version__ == pyproject["project"]["version"]


def test_dir_shows_the_public_api_only():
    import kivi_jax

    assert set(kivi_jax.__all__) <= set(dir(kivi_jax))
    assert all(hasattr(kivi_jax, name) for name in kivi_jax.__all__)
    extra = [n for n in dir(kivi_jax) if n not in kivi_jax.__all__]
    assert all(n.startswith("__") and n.endswith("__") for n in extra), extra
    assert "__version__" in extra


def test_the_design_docs_tree_layout_names_existing_files():
    design = (ROOT / "docs/design.md").read_text()
    section = design.split("## Layout of the tree", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    assert len(paths) >= 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
