python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl .whl-test/*.whl
M=tests/tokenspeed_kernel_triton/ops/moe
timeout 130 python3 -m pytest -q -rs -p no:cacheprovider -n 6 $M/test_moe_mx_swap_persistent.py 2>&1 | tail -4
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 4 -k "gpu" $M/test_moe_gemv.py 2>&1 | tail -2
taskset -c 3 timeout 70 python3 -m tokenspeed_kernel overhead --device cuda --no-breakdown --op moe.apply --json $OUT/overhead_moe.json 2>&1 | grep -v "amd' (tok" | tail -14
