"""`python -m engine_svc.kernels`: build the CPU kernels now and print their folder."""

from engine_svc.kernels.loader import main

main()
