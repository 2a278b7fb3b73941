// The headers every source includes, compiled once per build (engine_svc/kernels/build.py):
// parsing ATen's and torch's headers took 10-15 s of each source's 13-21 s compile. Each
// source still includes what it uses; this header only makes those includes cheap.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
