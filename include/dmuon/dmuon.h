// dmuon.h -- umbrella header: distributed Muon with dedicated ownership for LibTorch.
#pragma once

#include "dmuon/bootstrap.h"
#include "dmuon/checkpoint.h"
#include "dmuon/communicator.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/env.h"
#include "dmuon/grad_clip.h"
#include "dmuon/mesh.h"
#include "dmuon/model_specs.h"
#include "dmuon/muon.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/owner_plan.h"
#include "dmuon/process_group.h"
#include "dmuon/safetensors.h"
#include "dmuon/tensor_parallel.h"
#include "dmuon/unshard_profile.h"
