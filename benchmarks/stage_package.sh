# Sourced by the device scripts (h200_session.sh, kernel_profile.sh) from the repository root:
# the device machine gets the checkout only (no install), so this copies the package into
# /tmp/pk with models/ and pallas_kernels/ in place under kivi_jax/, as the wheel lays them
# out, and continues from there with it on PYTHONPATH.
rm -rf /tmp/pk && mkdir -p /tmp/pk
cp -r kivi_jax tests benchmarks pyproject.toml /tmp/pk/
cp -r models /tmp/pk/kivi_jax/models && cp -r pallas_kernels /tmp/pk/kivi_jax/pallas_kernels
cd /tmp/pk && export PYTHONPATH=/tmp/pk PYTHONUNBUFFERED=1
