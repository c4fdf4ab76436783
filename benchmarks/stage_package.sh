# Sourced by the device script (h200_session.sh) from the repository root:
# the device machine gets the checkout only (no install), so this copies the package into
# /tmp/pk with models/ and pallas_kernels/ in place under kivi_jax/, as the wheel lays them
# out, and continues from there with it on PYTHONPATH (README.md beside it: test_readme reads it
# when it is collected).
rm -rf /tmp/pk && mkdir -p /tmp/pk
cp -r kivi_jax tests benchmarks pyproject.toml README.md /tmp/pk/
cp -r models /tmp/pk/kivi_jax/models && cp -r pallas_kernels /tmp/pk/kivi_jax/pallas_kernels
cd /tmp/pk && export PYTHONPATH=/tmp/pk PYTHONUNBUFFERED=1
