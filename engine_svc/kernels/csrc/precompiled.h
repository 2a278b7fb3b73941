// The headers the sources include, compiled once per build (engine_svc/kernels/build.py):
// parsing ATen's and torch's headers took most of each source's compile. Each source still
// includes what it uses; this header only makes those includes cheap. ATen's per-operator
// headers (ATen/ops/*.h) rather than ATen/ATen.h, which declares every operator: 30% less
// to parse and a precompiled header of 330 MB instead of 440.
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
