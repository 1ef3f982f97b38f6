"""Mutation check: take out what makes a feature work, one line at a time, and see a named test fail.

Each mutation replaces one exact piece of source (it must occur exactly once) and names the
tests that must then fail. For each, the script edits the file in the working tree, runs
those tests, and puts the file back (also on Ctrl-C). It prints one row per mutation and
exits 1 if any mutation survives (its tests still pass) or no longer applies (the source
moved: update the mutation).

The mutations named "sync: ..." take out the synchronisation points of streaming to an
accelerator (each wait, record and synchronize, the temporary and staging buffers, copies
from pageable memory); their tests run on the suite's test device (tests/tardy) where no
GPU is present. docs/hardware.md has the table (``--only sync:``).

Run: .venv/bin/python scripts/mutate.py [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "undo: a block of surgery that fails is reverted (classes, entries, swapped tensors)",
        "src/torchsurgery/_undo.py",
        "        diff(state, model).revert(model)\n",
        "        pass\n",
        ("tests/offloading/test_dynamic_swap.py::test_install_model_failing_half_way_leaves_the_model_as_it_was",),
    ),
    Mutation(
        "undo: a block of surgery undone on failure gets back each module's undo log as it was",
        "src/torchsurgery/_undo.py",
        "            if log:\n                module.__dict__[_LOG_KEY] = log\n",
        "            if False:\n                module.__dict__[_LOG_KEY] = log\n",
        ("tests/offloading/test_dynamic_swap.py::test_a_reinstallation_failing_half_way_keeps_each_modules_stack_and_log",),
    ),
    Mutation(
        "undo: an installation under an offload made since is not replaced",
        "src/torchsurgery/offloading/dynamic_swap.py",
        '        _check_not_under_an_offload(model, "install_model")\n',
        "        pass\n",
        ("tests/offloading/test_dynamic_swap.py::test_an_installation_under_an_offload_made_since_is_not_replaced",),
    ),
    Mutation(
        "residency: a weight made resident after the first forward is remembered, so remove() gives it back",
        "src/torchsurgery/offloading/measured_residency.py",
        "            self.originals.remember(q.name, p)  # remove() gives it back",
        "            pass  # remove() gives it back",
        ("tests/offloading/test_engine_edges.py::test_weights_made_resident_after_the_first_forward_go_back_to_the_host_on_remove_also_when_pinned_before",),
    ),
    Mutation(
        "pool: a model's least is counted as its offload counts it (each weight routed as it streams)",
        "src/torchsurgery/offloading/plan.py",
        "    if device is not None:  # each weight as it would stream, as the offload's budget check takes them\n",
        "    if False:\n",
        ("tests/offloading/test_pool.py::test_a_pool_counts_the_least_a_model_needs_as_its_offload_does",),
    ),
    Mutation(
        "pool: a model on the host is sized again at each load (surgery since may have grown it)",
        "src/torchsurgery/offloading/pool.py",
        "        if member.handle is None:  # on the host: sized again",
        "        if False:  # on the host: sized again",
        ("tests/offloading/test_pool.py::test_a_model_patched_on_the_host_is_sized_again_when_loaded",),
    ),
    Mutation(
        "residency: a group sharing a weight with a streamed group is not made resident",
        "src/torchsurgery/offloading/measured_residency.py",
        "if n in streaming.packed and self._may_stay(n, resident)]",
        "if n in streaming.packed]",
        ("tests/offloading/test_engine_edges.py::test_groups_sharing_a_weight_stay_exact_whatever_the_first_forward_makes_resident",),
    ),
    Mutation(
        "undo: an offload removed before the surgery applied on top of it updates what that surgery gives back",
        "src/torchsurgery/offloading/engine.py",
        "        _undo.rebase_saved(model, self._record, [tensor for tensor, _ in restored])\n",
        "",
        ("tests/offloading/test_dynamic_swap.py::test_an_installation_over_a_loaded_model_undone_after_its_unload_gives_back_host_buffers",),
    ),
    Mutation(
        "a conversion is checked against the budget before the offload comes off",
        "src/torchsurgery/offloading/engine.py",
        "        plan_converted(model, seam, converted, offloaded_ok=True, **options)\n",
        "",
        ("tests/offloading/test_engine.py::test_a_conversion_the_budget_cannot_hold_is_refused_changing_nothing",),
    ),
    Mutation(
        "an offloaded module's .to(dtype) converts its weights (the offload is planned again)",
        "src/torchsurgery/offloading/conversion.py",
        "hand_over(t, wrap_like(t, t.detach().to(read_as).to(dtype)))",
        "pass",
        ("tests/offloading/test_engine.py::test_an_offloaded_model_takes_dtype_conversions_as_the_plain_model",),
    ),
    Mutation(
        "compat prints FramePack's lines",
        "src/torchsurgery/compat/framepack.py",
        "    if verbose:\n        print(line)",
        "    pass",
        ("tests/compat/test_framepack.py::test_the_app_pattern_in_its_dtypes_equals_the_app_s_own_memory_module",),
    ),
    Mutation(
        "a conversion's check plans the offload's own weights as the plain tensors they will be",
        "src/torchsurgery/offloading/plan.py",
        " or reads_elsewhere_only(t) or _undo.holder_of_any([t]) is not None\n",
        " or reads_elsewhere_only(t)\n",
        ("tests/offloading/test_engine_edges.py::test_a_conversion_the_least_budget_cannot_hold_is_refused_before_anything_changes",),
    ),
    Mutation(
        "state_dict of a scaled weight streamed to an accelerator is made on the host",
        "src/torchsurgery/compact/stored.py",
        "_own_storage(stored) if scale is None else dequantize(stored, scale.to(stored.device), value.dtype)\n",
        "_own_storage(stored) if scale is None else dequantize(stored.to(value.device), scale.to(value.device), value.dtype)\n",
        ("tests/offloading/test_scaled_streaming.py::test_state_dict_of_a_streamed_scaled_model_is_made_on_the_host",),
    ),
    Mutation(
        "a conversion inside a streamed group's own forward is refused",
        "src/torchsurgery/offloading/conversion.py",
        "    running = [name for name, streamer in streamers.items() if streamer.depth > 0]\n",
        "    running: list[str] = []\n",
        ("tests/offloading/test_engine_edges.py::test_a_conversion_inside_a_streamed_groups_own_forward_is_refused_changing_nothing",),
    ),
    Mutation(
        "offload refuses a part of a model offloaded whole",
        "src/torchsurgery/offloading/plan.py",
        "    holder = _undo.holder_of_any(model.parameters())\n",
        "    holder = None\n",
        ("tests/offloading/test_engine_edges.py::test_an_offload_of_a_part_of_an_offloaded_model_is_refused_before_anything_changes",),
    ),
    Mutation(
        "DynamicSwapInstaller: a copy read in inference mode is not reused where a gradient is needed",
        "src/torchsurgery/offloading/dynamic_swap.py",
        "                if cached.requires_grad or not tensor.requires_grad or not torch.is_grad_enabled():\n",
        "                if True:\n",
        ("tests/offloading/test_dynamic_swap.py::test_a_read_under_no_grad_first_does_not_cost_the_weight_its_gradient",),
    ),
    Mutation(
        "scaled: a view the broadcast scale cannot take takes a scale per value",
        "src/torchsurgery/compact/tensor.py",
        "            scales = func(scale.contiguous(), *rest, **kwargs)  # a scale per value: the same numbers\n",
        "            raise\n",
        ("tests/compact/test_scaled.py::test_views_and_elements_of_a_scaled_weight_read_as_the_plain_weights",),
    ),
    Mutation(
        "scaled: one element dequantises as a one-element tensor",
        "src/torchsurgery/compact/scaled.py",
        "    if q.dim() == 0:  # one element (w[0, 0]): as a one-element tensor, whose product promotes\n",
        "    if False:\n",
        ("tests/compact/test_scaled.py::test_views_and_elements_of_a_scaled_weight_read_as_the_plain_weights",),
    ),
    Mutation(
        "tardy runs LSTM cells (PyTorch sends them to a fused kernel on every device but the CPU)",
        "tests/tardy/tardy.cpp",
        '  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));\n',
        "",
        ("tests/tardy/test_module_db.py::test_the_module_computes_on_the_device_what_it_computes_on_the_cpu",),
    ),
    Mutation(
        "tardy runs the CPU's SiLU backward, not PyTorch's composite one",
        "tests/tardy/tardy.cpp",
        '  m.impl("silu_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());\n',
        "",
        ("tests/tardy/test_module_db.py::test_the_module_computes_on_the_device_what_it_computes_on_the_cpu",),
    ),
    Mutation(
        "checkpoints: ComfyUI's comfy_quant layers (weight_scale) are read as scaled fp8",
        "src/torchsurgery/_checkpoint.py",
        '_SCALE_KEYS, _INPUT_SCALE_KEYS = ("scale_weight", "weight_scale"), ("scale_input", "input_scale")\n',
        '_SCALE_KEYS, _INPUT_SCALE_KEYS = ("scale_weight",), ("scale_input", "input_scale")\n',
        ("tests/compact/test_comfy_checkpoint.py::test_comfy_quant_layers_load_into_a_plain_model_as_comfyui_dequantises_them",),
    ),
    Mutation(
        "scaled: an all-zero channel keeps a scale of one (zeros, not 0 / 0)",
        "src/torchsurgery/compact/scaled.py",
        "        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero channel\n",
        "",
        ("tests/compact/test_scaled.py::test_an_all_zero_channel_reads_as_zeros",),
    ),
    Mutation(
        "scaled: a write past a row's range saturates (int8 would wrap around)",
        "src/torchsurgery/compact/scaled.py",
        "    ratio = (values.detach().float() / scale).clamp_(-largest, largest)\n",
        "    ratio = values.detach().float() / scale\n",
        ("tests/compact/test_scaled.py::test_a_write_past_a_rows_range_saturates_and_never_wraps_around",),
    ),
    Mutation(
        "scaled: a load of plain values chooses a new scale from them",
        "src/torchsurgery/tensors/loading.py",
        "        plain_values = {id(t): torch.empty(t.shape, dtype=t.dtype) for t, _ in run if own_scale(t) is not None}\n",
        "        plain_values: dict[int, torch.Tensor] = {}\n",
        ("tests/compact/test_scaled.py::test_load_of_plain_values_chooses_a_scale_from_them",),
    ),
    Mutation(
        "scaled: a narrow compute dtype dequantises before the product",
        "src/torchsurgery/compact/scaled.py",
        " or x.dtype.itemsize < torch.float32.itemsize:\n",
        ":\n",
        ("tests/compact/test_scaled.py::test_a_narrow_compute_dtype_sums_scaled_values_as_the_plain_layer_does",),
    ),
    Mutation(
        "scaled: a weight with an inf or NaN is refused at offload",
        "src/torchsurgery/offloading/plan.py",
        "        if bad:\n            raise ArgumentValueError(\n                _WHAT, \"storage_dtype\", p.scaled,\n",
        "        if False:\n            raise ArgumentValueError(\n                _WHAT, \"storage_dtype\", p.scaled,\n",
        ("tests/compact/test_scaled.py::test_a_weight_with_an_inf_or_nan_is_refused_by_name_and_the_model_is_left_as_it_was",),
    ),
    Mutation(
        "a compiled backward multiplies by the widened weight, as eager's backward does",
        "src/torchsurgery/compact/tensor.py",
        "not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1",
        "not torch.is_grad_enabled()",
        ("tests/compact/test_compile.py::test_a_compiled_backward_multiplies_by_the_widened_weight_as_eager_s_does",),
    ),
    Mutation(
        "tardy runs the CPU's group norm, not PyTorch's composite one (channels-last inputs)",
        "tests/tardy/tardy.cpp",
        '  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());\n',
        "",
        ("tests/tardy/test_tardy.py::test_norms_run_the_cpus_kernels_whatever_the_layout",),
    ),
    Mutation(
        "Tensor.to reaching the weight's dispatch whole (inference mode) is decomposed as PyTorch does",
        "src/torchsurgery/compact/tensor.py",
        "    **dict.fromkeys([_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout, _aten.to.other], _decomposed),\n",
        "",
        ("tests/compact/test_tensor_api.py::test_to_gives_what_it_gives_for_the_plain_weight_in_and_out_of_inference_mode",),
    ),
    Mutation(
        "the device rule: a weight kept on the host reads as the device the offload computes on",
        "src/torchsurgery/offloading/install.py",
        "where = device if p.reads_elsewhere(device) else None",
        "where = None",
        ("tests/offloading/test_generate_on_device.py::test_the_offloaded_model_reads_as_a_model_on_the_device",),
    ),
    Mutation(
        "the device rule: a weight reading as the device gives its values there",
        "src/torchsurgery/compact/values.py",
        "return stored.to(device=t.device, dtype=t.dtype)",
        "return stored.to(dtype=t.dtype)",
        ("tests/compact/test_tensor_api.py::test_a_streamed_weight_reads_as_a_tensor_on_the_device",),
    ),
    Mutation(
        "views of a normal weight made in inference mode are normal tensors",
        "src/torchsurgery/compact/tensor.py",
        "with torch.inference_mode(self.is_inference()) if torch.is_inference_mode_enabled() else contextlib.nullcontext():",
        "with contextlib.nullcontext():",
        ("tests/compact/test_tensor_api.py::test_views_made_in_inference_mode_are_normal_tensors_as_the_plain_weight_s",),
    ),
    Mutation(
        "a budget counts the ring's prefetch + 1 slots",
        "src/torchsurgery/offloading/budgets.py",
        "return buffers + held + (prefetch + 1) * slot + max((r for _, r in streamed), default=0) + widened",
        "return buffers + held + slot + max((r for _, r in streamed), default=0) + widened",
        ("tests/offloading/test_engine_edges.py::test_the_device_peak_stays_within_a_budget_at_every_prefetch[3]",),
    ),
    Mutation(
        "a forward that raised does not make groups resident",
        "src/torchsurgery/offloading/attach.py",
        "self.hooks.append(model.register_forward_hook(AfterFirst(streaming, after_first)))",
        "self.hooks.append(model.register_forward_hook(AfterFirst(streaming, after_first), always_call=True))",
        ("tests/offloading/test_engine_edges.py::test_out_of_memory_in_the_first_forward_leaves_the_offload_working",),
    ),
    Mutation(
        "residency that failed after a forward is chosen again after the next",
        "src/torchsurgery/offloading/streams.py",
        "        except BaseException:\n            self.after = after\n            raise\n",
        "        except BaseException:\n            raise\n",
        ("tests/offloading/test_engine_edges.py::test_out_of_memory_while_making_groups_resident_leaves_every_group_streaming",),
    ),
    Mutation(
        "an offload's remove gives a weight back kept as it was kept (an installer's)",
        "src/torchsurgery/offloading/originals.py",
        "tensor, dtype = o.tensor, o.kept or o.dtype",
        "tensor, dtype = o.tensor, o.dtype",
        ("tests/offloading/test_dynamic_swap.py::test_an_offload_over_an_installation_gives_back_the_weights_as_installed",),
    ),
    Mutation(
        "a master weight's narrow copy is a declared field of the flattened tensor",
        "src/torchsurgery/compact/tensor.py",
        'inner = [STORED] if self.__dict__[SHADOW] is None else [STORED, "_shadow_values"]',
        "inner = [STORED]",
        ("tests/compact/test_tensor_api.py::test_a_compiled_no_grad_forward_of_a_master_weight_reads_its_narrow_copy_as_eager_does",),
    ),
    Mutation(
        "products under autocast and torch.func transforms go on to dispatch, after them",
        "src/torchsurgery/compact/tensor.py",
        "        torch._C._is_any_autocast_enabled()\n        or torch._C._are_functorch_transforms_active()\n",
        "        False\n",
        ("tests/compact/test_tensor_api.py::test_autocast_sees_the_plain_linear[dtype0]", "tests/compact/test_tensor_api.py::test_vmap_batches_the_plain_linear"),
    ),
    Mutation(
        "weight.data = t writes t's values into the weight",
        "src/torchsurgery/compact/tensor_api.py",
        "        store(t, values)\n        written_in_place(t)\n        return\n",
        "        return\n",
        ("tests/compact/test_tensor_api.py::test_data_assignment_writes_the_values_rounded_as_stored",),
    ),
    Mutation(
        "a cached build of the native kernel is loaded by offload, not in the background",
        "src/torchsurgery/compact/narrow_matvec.py",
        "                library.fn = _installed(name) or _load(path)\n",
        "                library.fn = _installed(name)\n",
        ("tests/compact/test_narrow.py::test_a_cached_build_is_loaded_before_the_first_forward",),
    ),
    Mutation(
        "the kernel built at install time is loaded by offload, nothing built",
        "src/torchsurgery/compact/narrow_matvec.py",
        "                library.fn = _installed(name) or _load(path)\n",
        "                library.fn = _load(path)\n",
        ("tests/compact/test_narrow_matvec.py::test_the_library_the_install_built_is_loaded_without_a_build",),
    ),
    Mutation(
        "a library's name carries the CPU features it was built for",
        "src/torchsurgery/compact/native_build.py",
        "    parts = [source, *_flags_for(arch), _compiler(), _cpu_features(), str(kind)]\n",
        "    parts = [source, *_flags_for(arch), _compiler(), str(kind)]\n",
        ("tests/compact/test_narrow_matvec.py::test_a_library_built_on_another_machine_is_not_loaded",),
    ),
    Mutation(
        "setup.py builds the kernels at install time",
        "setup.py",
        "        for kind, why in native.build_all(directory).items():\n",
        "        for kind, why in {}.items():\n",
        ("tests/compact/test_narrow_matvec.py::test_setup_builds_the_kernels_at_install_and_installs_without_a_compiler",),
    ),
    Mutation(
        "an e4m3fn NaN in a row makes the kernel's sums NaN (its pattern would read as 480)",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "if (has_e4m3_nan(w, base, in)) {", "if (false) {",
        ("tests/compact/test_narrow_matvec.py::test_a_nan_weight_in_a_long_row_makes_its_outputs_nan_and_no_other",),
    ),
    Mutation(
        "the kernel: an e4m3fn NaN widened one value at a time is NaN, not 480",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "    if ((b & 0x7f) == 0x7f) return bits_to_float(0x7fc00000u);  // e4m3fn's only NaN\n", "",
        ("tests/compact/test_narrow_matvec.py::test_an_e4m3fn_nan_at_every_place_of_a_row_makes_its_outputs_nan",
         "tests/compact/test_narrow_matvec.py::test_an_e4m3fn_nan_at_every_place_of_a_weight_stored_in_out_makes_its_column_nan"),
    ),
    Mutation(
        "the kernel: the generic path's NaN scan reads a row's last bytes (past its 64-byte steps)",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "  for (; i < n; ++i) any |= (b[i] & 0x7f) == 0x7f;\n", "",
        ("tests/compact/test_narrow_matvec.py::test_an_e4m3fn_nan_at_every_place_of_a_row_makes_its_outputs_nan",),
    ),
    Mutation(
        "undo: an installation under an offload made since is not removed (its forwards would mix devices)",
        "src/torchsurgery/offloading/dynamic_swap.py",
        '        _check_not_under_an_offload(model, "uninstall_model")\n', "",
        ("tests/offloading/test_dynamic_swap.py::test_an_installation_under_an_offload_made_since_is_not_removed",),
    ),
    Mutation(
        "kernel (issue 35): the scale multiplies each sum",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "    if (scale) sum *= scale[o * scale_step];\n", "",
        ("tests/compact/test_narrow_matvec.py::test_the_scale_multiplies_each_sum_before_the_bias",),
    ),
    Mutation(
        "kernel (issue 35): the per-tensor scale is one value for every output (step 0)",
        "src/torchsurgery/compact/narrow_matvec.py",
        "        return 0\n    if scale.dim() == 1 and scale.numel() == out", "        return 1\n    if scale.dim() == 1 and scale.numel() == out",
        ("tests/compact/test_narrow_matvec.py::test_the_scale_multiplies_each_sum_before_the_bias",),
    ),
    Mutation(
        "kernel (issue 35): the tail columns of a row (past the last whole vector) are summed",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "    for (int64_t j = k; j < in; ++j) s += widen1<K>(w, base + j) * x[r * in + j];\n", "",
        ("tests/compact/test_narrow_matvec.py::test_outputs_match_fp32_for_many_shapes_rows_and_biases",),
    ),
    Mutation(
        "kernel (issue 35): fp8 in 64-byte blocks: the last columns, one at a time, are summed",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "    for (; j < in; ++j) s += widen1<K>(w, base + j) * xp[r * in + j];\n", "",
        ("tests/compact/test_narrow_matvec.py::test_every_fp8_pattern_at_many_places_of_long_rows_is_exact",),
    ),
    Mutation(
        "kernel (issue 35): a weight [in, out]: the columns past the last whole vector are summed",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "        for (int64_t j = full; j < width; ++j)\n", "        for (int64_t j = width; j < width; ++j)\n",
        ("tests/compact/test_narrow_matvec.py::test_outputs_match_fp32_for_many_shapes_rows_and_biases",),
    ),
    Mutation(
        "kernel (issue 35): the thread split covers every output (the last part takes the remainder)",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "const int64_t per = (n + parts - 1) / parts,", "const int64_t per = n / parts,",
        ("tests/compact/test_narrow_matvec.py::test_every_split_over_threads_gives_the_same_outputs",),
    ),
    Mutation(
        "kernel (issue 35): int8 is widened with its sign",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(", "_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(",
        ("tests/compact/test_narrow_matvec.py::test_every_bit_pattern_widens_exactly",
         "tests/compact/test_narrow_matvec.py::test_outputs_match_fp32_for_many_shapes_rows_and_biases"),
    ),
    Mutation(
        "kernel on AVX2 (issue 35): int8 is widened with its sign",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(", "_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(",
        ("tests/compact/test_narrow_matvec.py::test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact[haswell]",),
    ),
    Mutation(
        "kernel on AVX2 (issue 35): the e4m3fn NaN scan compares every 32 bytes",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "found = _mm256_or_si256(found, _mm256_cmpeq_epi8(v, magnitude));", "found = _mm256_or_si256(found, _mm256_setzero_si256());",
        ("tests/compact/test_narrow_matvec.py::test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact[haswell]",),
    ),
    Mutation(
        "kernel on AVX2 (issue 35): fp8 widened 16 bytes at a time: the second vector is the upper 8",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "b = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));", "b = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(h));",
        ("tests/compact/test_narrow_matvec.py::test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact[haswell]",),
    ),
    Mutation(
        "kernel on the x86-64 baseline (issue 35): the e4m3fn NaN scan compares every 16 bytes",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "found = _mm_or_si128(found, _mm_cmpeq_epi8(v, magnitude));", "found = _mm_or_si128(found, _mm_setzero_si128());",
        ("tests/compact/test_narrow_matvec.py::test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact[x86-64]",),
    ),
    Mutation(
        "import: a streamer's transfers run outside compiled regions once the first Streaming is made",
        "src/torchsurgery/offloading/streams.py",
        "    def __init__(self, device: OffloadDevice, stats: OffloadStats, prefetch: int = 1) -> None:\n        _transfers_outside_compiled()\n",
        "    def __init__(self, device: OffloadDevice, stats: OffloadStats, prefetch: int = 1) -> None:\n",
        ("tests/test_import.py::test_import_leaves_the_compiler_unimported_until_a_weight_is_made",),
    ),
    Mutation(
        "import: the weight's entry points run as Python under the compiler once the first weight is made",
        "src/torchsurgery/compact/tensor.py",
        "        if not _skipped_by_the_compiler:\n            _skip_in_compiled_frames()\n", "",
        ("tests/compact/test_compile.py::test_a_compiled_flex_model_over_an_offloaded_model_compiles_once_and_equals_eager",),
    ),
    Mutation(
        "pool: unload_all pushes every model back",
        "src/torchsurgery/offloading/pool.py",
        "        for member in self._members:\n            member.push_back()\n",
        "        for member in self._members[:1]:\n            member.push_back()\n",
        ("tests/offloading/test_pool.py::test_unload_all_pushes_every_model_back_and_frees_what_they_held",),
    ),
    Mutation(
        "residency: groups swapped in go back when the ring made again for the groups left does not fit",
        "src/torchsurgery/offloading/measured_residency.py",
        "            for tensor, replacement in reversed(swapped):\n                swap_in(tensor, replacement)\n", "",
        ("tests/offloading/test_engine_edges.py::test_out_of_memory_making_the_ring_again_after_groups_went_resident_leaves_every_group_streaming",),
    ),
    Mutation(
        "residency: the statistics go back with them",
        "src/torchsurgery/offloading/measured_residency.py",
        "            stats.resident_groups[:], stats.streamed_groups[:], stats.resident_bytes = resident_groups, streamed_groups, resident_bytes\n", "",
        ("tests/offloading/test_engine_edges.py::test_out_of_memory_making_the_ring_again_after_groups_went_resident_leaves_every_group_streaming",),
    ),
    Mutation(
        "scaled (issue 35): bf16 and fp16 are dequantised in place, with no fp32 copy besides (the plan counts none)",
        "src/torchsurgery/compact/scaled.py",
        "        return q.to(dtype, copy=True).mul_(scale if scale.dim() else scale.reshape(1))",
        "        return q.to(torch.float32, copy=True).mul_(scale).to(dtype)",
        ("tests/offloading/test_scaled_streaming.py::test_streamed_through_the_ring_a_scaled_weight_is_the_dequantised_weight_bit_for_bit",),
    ),
    Mutation(
        "kernel (issue 35): e4m3fn widened whole reads a negative NaN as NaN (its pattern reads -480)",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "vu32 nan = (vu32)((f == 480.0f) | (f == -480.0f));", "vu32 nan = (vu32)(f == 480.0f);",
        ("tests/compact/test_narrow_matvec.py::test_an_e4m3fn_nan_at_every_place_of_a_weight_stored_in_out_makes_its_column_nan",
         "tests/compact/test_narrow_matvec.py::test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact[haswell]"),
    ),
    Mutation(
        "fp8 in 64-byte blocks: x is laid out in the order the byte unpacks leave the weights in",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "kChunks[8] = {0, 2, 4, 6, 1, 3, 5, 7};", "kChunks[8] = {0, 1, 2, 3, 4, 5, 6, 7};",
        ("tests/compact/test_narrow_matvec.py::test_every_fp8_pattern_at_many_places_of_long_rows_is_exact",),
    ),
    Mutation(
        "e4m3fn in 64-byte blocks: the sign is put back after the table lookup of the magnitude",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "0xf8);  // A | (B & C)", "0xf0);  // A | (B & C)",
        ("tests/compact/test_narrow_matvec.py::test_every_fp8_pattern_at_many_places_of_long_rows_is_exact",),
    ),
    Mutation(
        "e4m3fn in 64-byte blocks: the table gives NaN for e4m3fn's NaN pattern (not 480)",
        "src/torchsurgery/compact/narrow_matvec.cpp",
        "bits = 0x7e00;  // NaN", "bits = 0x5f80;  // NaN",
        ("tests/compact/test_narrow_matvec.py::test_a_nan_weight_in_a_long_row_makes_its_outputs_nan_and_no_other",
         "tests/compact/test_narrow_matvec.py::test_every_fp8_pattern_at_many_places_of_long_rows_is_exact"),
    ),
    Mutation(
        "a compiled forward calls the narrow product, not a widened copy of each weight",
        "src/torchsurgery/compact/tensor.py",
        "    _aten.mm.default: _matmul,\n", "",
        ("tests/offloading/test_engine.py::test_a_compiled_forward_reads_the_narrow_weights_without_widening_them",),
    ),
    Mutation(
        "while the native kernel builds, few rows are served through the cache, not compiled",
        "src/torchsurgery/compact/narrow.py",
        'pending = scale is None and getattr(narrow_matvec, "pending", False)', "pending = False",
        ("tests/compact/test_narrow.py::test_a_forward_does_not_wait_for_the_kernel_build",),
    ),
    Mutation(
        "offload starts the kernel build before the first forward",
        "src/torchsurgery/compact/stored.py",
        "    prepare_kernel(shadow_dtype if shadow_dtype is not None else stored.dtype, stored.device)\n", "",
        ("tests/compact/test_narrow.py::test_a_forward_does_not_wait_for_the_kernel_build",),
    ),
    Mutation(
        "a ring slot is reused only while its group's weights are unchanged",
        "src/torchsurgery/offloading/streams.py",
        "if self.copied[slot] != group.version():", "if False:",
        ("tests/offloading/test_device.py::test_groups_kept_in_the_ring_are_copied_again_when_their_host_weights_change",),
    ),
    Mutation(
        "streams: a group's version counts writes through .data and views (its stored values' counters)",
        "src/torchsurgery/offloading/streams.py",
        "sum(v._version for v in self.slot_values() if", "sum(v._version for v in self.tensors if",
        ("tests/offloading/test_device.py::test_writes_through_data_or_a_view_reach_the_groups_kept_in_the_ring",),
    ),
    # speed only (results stay exact): the test device's copy log shows where copies run and
    # whether the host waited for them, without timing anything
    Mutation(
        "streams: a forward with gradients issues its groups' copies without the host waiting for them",
        "src/torchsurgery/offloading/streams.py",
        "value = torch.ops.aten._to_copy.default(p, device=device.device, dtype=through or dtype, non_blocking=True)",
        "value = torch.ops.aten._to_copy.default(p, device=device.device, dtype=through or dtype, non_blocking=False)",
        ("tests/offloading/test_device.py::test_a_forward_with_gradients_issues_each_groups_copies_without_waiting_for_them",),
    ),
    Mutation(
        "streams: the ring's copies are issued on the side stream",
        "src/torchsurgery/offloading/streams.py",
        "device.copy_(buffer[offset : offset + source.numel()], source, self.side)",
        "device.copy_(buffer[offset : offset + source.numel()], source, device.current_stream())",
        ("tests/offloading/test_device.py::test_groups_come_in_on_the_side_stream_while_the_group_before_computes",),
    ),
    Mutation(
        "streams: AcceleratorDevice.copy_ runs a copy on the stream it is given",
        "src/torchsurgery/_device.py",
        "        with stream:\n            dst.copy_(src, non_blocking=True)",
        "        if stream is not None:\n            dst.copy_(src, non_blocking=True)",
        ("tests/offloading/test_device.py::test_groups_come_in_on_the_side_stream_while_the_group_before_computes",),
    ),
    Mutation(
        "load_ counts the bytes it writes straight into memory as an in-place write",
        "src/torchsurgery/tensors/loading.py",
        "            torch.autograd.graph.increment_version(t)\n", "",
        ("tests/offloading/test_device.py::test_groups_kept_in_the_ring_are_copied_again_when_their_host_weights_change",),
    ),
    Mutation(
        "a load that fails half-way puts back the values it had overwritten",
        "src/torchsurgery/tensors/loading.py",
        "        stash.restore()\n", "        pass\n",
        ("tests/test_tensors.py::test_a_read_failing_at_any_point_leaves_every_tensor_as_it_was",),
    ),
    Mutation(
        "load_(undoable=False) keeps nothing aside",
        "src/torchsurgery/tensors/loading.py",
        "stash = Stash(written) if undoable else None", "stash = Stash(written)",
        ("tests/test_tensors.py::test_a_read_failing_without_undo_says_the_module_is_partly_loaded",),
    ),
    Mutation(
        "load_(undoable=False) failing after its first write says the module is partly loaded",
        "src/torchsurgery/tensors/loading.py",
        "    elif in_place and isinstance(exc, Exception):", "    elif False:",
        ("tests/test_tensors.py::test_a_read_failing_without_undo_says_the_module_is_partly_loaded",),
    ),
    Mutation(
        "writes through an OffloadedTensor are counted in its values' version counter",
        "src/torchsurgery/compact/values.py",
        "    torch.autograd.graph.increment_version(t.__dict__[COUNTER])", "    pass",
        ("tests/compact/test_tensor.py::test_writes_land_in_the_stored_values_through_views_data_and_optimizers",
         "tests/compact/test_tensor.py::test_a_master_copy_serves_gradients_and_a_refreshed_shadow_serves_inference"),
    ),
    Mutation(
        "every forward that records gradients reads the master values",
        "src/torchsurgery/compact/tensor.py",
        "whole = not fits or (grad and (shadow is not None or _needs_graph(x, weight, bias)))",
        "whole = not fits or (grad and _needs_graph(x, weight, bias))",
        ("tests/test_invisible_surgery.py::test_peft_lora_trains_through_an_offload_with_an_fp32_master_as_in_fp32",),
    ),
    Mutation(
        "weights stored narrow read as the compute dtype",
        "src/torchsurgery/offloading/install.py",
        "for p in filter(self._wrapped, self.plan.params):\n            tensor = p.lookup_in(self.named)\n",
        "for p in []:\n            tensor = p.lookup_in(self.named)\n",
        ("tests/test_invisible_surgery.py::test_stable_diffusion_with_an_offloaded_unet_equals_diffusers_layerwise_casting",
         "tests/test_invisible_surgery.py::test_generate_and_what_programs_read_are_those_of_the_plain_model[t5-offload]"),
    ),
    Mutation(
        "a patch that passes its arguments on shows the signature of the forward it passes to",
        "src/torchsurgery/patching.py",
        "forward = _passing_on(patch_cls)", "forward = None",
        ("tests/test_invisible_surgery.py::test_generate_passes_logits_to_keep_through_a_class_swap",),
    ),
    Mutation(
        "a compiled streamed group brings its weights in inside the graph",
        "src/torchsurgery/offloading/streams.py",
        "if torch.compiler.is_compiling() and streamer.traceable:", "if False:",
        ("tests/offloading/test_engine.py::test_an_offloaded_model_compiles_once_with_fullgraph_like_the_plain_model",
         "tests/offloading/test_device.py::test_a_model_streamed_to_a_device_compiles_once_with_fullgraph"),
    ),
    Mutation(
        "a dispatch mode (make_fx, FlopCounterMode) sees the products of narrow weights",
        "src/torchsurgery/compact/tensor.py",
        "        or _python_dispatch._get_current_dispatch_mode() is not None\n",
        "",
        ("tests/compact/test_tensor.py::test_dispatch_modes_see_the_products_of_an_offloaded_model",),
    ),
    Mutation(
        "products are taken from the narrow values for plain inputs only (not the compiler's)",
        "src/torchsurgery/compact/tensor.py",
        "    if not (type(x) is torch.Tensor and isinstance(weight, OffloadedTensor)",
        "    if not (isinstance(x, torch.Tensor) and isinstance(weight, OffloadedTensor)",
        ("tests/offloading/test_engine.py::test_an_offloaded_model_compiles_once_with_fullgraph_like_the_plain_model",
         "tests/compact/test_tensor.py::test_under_fake_tensor_mode_an_offloaded_model_computes_what_the_plain_model_does"),
    ),
    Mutation(
        "the end-of-forward hook records nothing inside compiled code",
        "src/torchsurgery/offloading/streams.py",
        "        if torch.compiler.is_compiling():\n            return  # compiled forwards", "        if False:\n            return  # compiled forwards",
        ("tests/offloading/test_engine.py::test_compiling_before_the_first_eager_forward_leaves_the_budget_planning_to_it",),
    ),
    Mutation(
        "state_dict() holds the stored values",
        "src/torchsurgery/offloading/attach.py",
        "        self.hooks.append(owner.register_state_dict_post_hook(stored_state))\n", "",
        ("tests/compact/test_tensor.py::test_state_dict_holds_the_stored_values_and_loads_back_exactly",),
    ),
    Mutation(
        "a patch that reads weight memory directly keeps its module from narrow storage",
        "src/torchsurgery/offloading/plan.py",
        "    _check_plain_readers(named, plan)\n", "",
        ("tests/offloading/test_engine.py::test_a_patch_that_cannot_serve_narrow_weights_is_refused_in_either_order",),
    ),
    Mutation(
        "products without gradients read the narrow values in place",
        "src/torchsurgery/compact/tensor.py",
        "_PRODUCTS: dict[Callable[..., Any], Callable[..., torch.Tensor | None]] = {F.linear: _linear, torch.addmm: _addmm}",
        "_PRODUCTS: dict[Callable[..., Any], Callable[..., torch.Tensor | None]] = {}",
        ("tests/compact/test_narrow.py::test_narrow_path_matches_fp32_for_many_shapes_and_rows",),
    ),
    Mutation(
        "unpatch swaps a tensor its patch converted back",
        "src/torchsurgery/_undo.py",
        "            if type(tensor) is kind and ", "            if True and ",
        ("tests/compact/test_tensor.py::test_the_undo_log_swaps_a_patchs_converted_weights_back",),
    ),
    Mutation(
        "an undo swaps a weight back also where a live output's graph saved it",
        "src/torchsurgery/_undo.py",
        "swap_in(tensor, wrap_like(tensor, alias, kind), pending_backward_ok=True)",
        "swap_in(tensor, wrap_like(tensor, alias, kind))",
        ("tests/test_undo.py::test_uninstall_after_a_patch_and_a_flex_model_while_an_output_lives",),
    ),
    Mutation(
        "a gradient goes along a swap",
        "src/torchsurgery/_swap.py",
        "        replacement.grad = grad.to(device=replacement.device, dtype=replacement.dtype)", "        pass",
        ("tests/offloading/test_dynamic_swap.py::test_training_through_it_updates_the_stored_weights",),
    ),
    Mutation(
        "DynamicSwapInstaller: a forward reads a weight kept narrow as a plain converted copy, not through the narrow product",
        "src/torchsurgery/offloading/dynamic_swap.py",
        '                kwargs = {**kwargs, "copy": True}\n', "                pass\n",
        ("tests/offloading/test_dynamic_swap_generate.py::"
         "test_generate_scores_and_hidden_states_are_bitwise_those_of_the_converted_model[llama-bf16_to_fp32]",),
    ),
    Mutation(
        "audit/weight: after a copy's groups are packed again, writes count in the new values' version counter",
        "src/torchsurgery/compact/tensor.py",
        "        d[STORED] = d[COUNTER] = stored.detach()\n", "        d[STORED] = stored.detach()\n",
        ("tests/offloading/test_engine.py::test_writes_into_a_pickled_copy_after_its_groups_are_packed_again_reach_its_forwards",),
    ),
    Mutation(
        "audit/weight: after a master is packed again, its narrow copy follows the new values",
        "src/torchsurgery/compact/tensor.py",
        "            shadow.follow(d[STORED])\n", "            pass\n",
        ("tests/offloading/test_engine.py::"
         "test_writes_into_a_pickled_copy_after_its_groups_are_packed_again_reach_its_forwards[accelerator-fp32-master]",),
    ),
    Mutation(
        "audit/weight: copy_ and load_state_dict into an offloaded weight count as a write",
        "src/torchsurgery/compact/tensor.py",
        "        dst.stored.copy_(src_values, **kwargs)  # rounded to the storage dtype, no widened copy\n"
        "        written_in_place(dst)\n",
        "        dst.stored.copy_(src_values, **kwargs)  # rounded to the storage dtype, no widened copy\n",
        ("tests/offloading/test_engine.py::test_load_state_dict_and_copy_into_offloaded_weights_reach_the_forwards_as_writes",),
    ),
    Mutation(
        "audit/weight: a conversion or factory with no dtype gives the dtype the weight reads as, not the stored one",
        "src/torchsurgery/compact/tensor.py",
        '    if kwargs.get("dtype") is None:\n        kwargs = {**kwargs, "dtype": t.dtype}\n', "",
        ("tests/compact/test_tensor_api.py::"
         "test_conversions_and_factories_without_a_dtype_give_the_dtype_the_weight_reads_as",),
    ),
    Mutation(
        "audit/weight: DynamicSwapInstaller converts a weight read under no_grad with a graph (used with grad, it gets one)",
        "src/torchsurgery/offloading/dynamic_swap.py",
        "            with torch.enable_grad():\n                value = tensor.to(**kwargs)\n",
        "            value = tensor.to(**kwargs)\n",
        ("tests/offloading/test_dynamic_swap.py::test_a_weight_read_under_no_grad_and_used_with_grad_gets_its_gradient",),
    ),
    Mutation(
        "audit/weight: DynamicSwapInstaller.install_model failing half-way puts back the modules it installed",
        "src/torchsurgery/offloading/dynamic_swap.py",
        "        with _undo.all_or_nothing(model):\n            for module in model.modules():\n",
        "        with torch.no_grad():\n            for module in model.modules():\n",
        ("tests/offloading/test_dynamic_swap.py::test_install_model_failing_half_way_leaves_the_model_as_it_was",
         "tests/offloading/test_dynamic_swap.py::test_a_reinstallation_failing_half_way_keeps_each_modules_stack_and_log"),
    ),
    Mutation(
        "audit/weight: DynamicSwapInstaller: a re-install failing on a module keeps the installation it replaced",
        "src/torchsurgery/offloading/dynamic_swap.py",
        "        with _undo.all_or_nothing(module):  # a failed re-install keeps the installation it replaced\n",
        "        with torch.no_grad():\n",
        ("tests/offloading/test_dynamic_swap.py::test_install_module_failing_keeps_the_installation_it_replaces",),
    ),
    Mutation(
        "resident weights are stored in the storage dtype, as streamed ones",
        "src/torchsurgery/offloading/install.py",
        "                    moves.append((p, tensor, target, dtype, False))\n",
        "                    moves.append((p, tensor, target, p.compute_dtype, False))\n",
        ("tests/offloading/test_engine.py::test_storage_dtype_computes_and_holds_the_same_whatever_the_budget[cpu-mlp-bf16]",
         "tests/offloading/test_pool.py::test_a_model_loaded_with_a_storage_dtype_computes_as_offloaded_whole_or_partly[cpu]"),
    ),
    Mutation(
        "a storage or master dtype is one weights can be stored in",
        "src/torchsurgery/_validate.py",
        "    if not isinstance(value, torch.dtype) or value not in STORAGE_DTYPES:\n",
        "    if not isinstance(value, torch.dtype):\n",
        ("tests/offloading/test_plan.py::test_a_dtype_weights_cannot_be_stored_in_is_a_type_error_naming_the_choices"
         "[torch.float8_e8m0fnu-storage_dtype-offload]",
         "tests/test_validate.py::test_check_storage_dtype_takes_the_dtypes_weights_convert_to_and_back_and_checkpoints_name"
         "[torch.float8_e8m0fnu]"),
    ),
    Mutation(
        "a master dtype must hold the values of the weights it keeps",
        "src/torchsurgery/offloading/plan.py",
        "                    _check_master_holds(master_dtype, name, stored_values(p).dtype)  # the values as kept\n", "",
        ("tests/offloading/test_plan.py::test_a_master_dtype_must_hold_the_weights_values_exactly"
         "[torch.float32-torch.bfloat16-torch.float8_e4m3fn-False]",),
    ),
    Mutation(
        "a streamed weight with a master reads its narrow copy's values without gradients, as a resident one",
        "src/torchsurgery/offloading/streams.py",
        "    return narrow if narrow is not None and not torch.is_grad_enabled() else None\n",
        "    return None\n",
        ("tests/offloading/test_engine.py::test_storage_dtype_computes_and_holds_the_same_whatever_the_budget"
         "[accelerator-mlp-bf16-fp32-master]",),
    ),
    # the synchronisation points of streaming to an accelerator, caught on the suite's test
    # device (tests/tardy): a missing wait reads poisoned memory or raises a hazard there
    Mutation(
        "sync: the compute stream waits for a group's copy before reading its slot",
        "src/torchsurgery/offloading/streams.py",
        "        device.wait(device.current_stream(), self.ready[slot])\n", "",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pinned-lazy]",),
    ),
    Mutation(
        "sync: the compute stream waits for a copy from pageable memory",
        "src/torchsurgery/offloading/streams.py",
        "        device.wait(device.current_stream(), self.ready[slot])\n", "",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pageable-lazy]",),
    ),
    Mutation(
        "sync: a copy into a slot waits for the slot's last use",
        "src/torchsurgery/offloading/streams.py",
        "            device.wait(self.side, self.released[slot])  # never overwrite", "            pass  # never overwrite",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pinned-random-delays]",),
    ),
    Mutation(
        "sync: a slot's last use is recorded after the compute that reads it",
        "src/torchsurgery/offloading/streams.py",
        "        self.released[slot] = self.device.record(self.device.current_stream())", "        pass",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pinned-random-delays]",),
    ),
    Mutation(
        "sync: the temporary buffer of a group met while every slot is busy is filled in the compute stream's order",
        "src/torchsurgery/offloading/streams.py",
        "device.copy_(buffer, temporary, device.current_stream())", "device.copy_(buffer, temporary, self.side)",
        ("tests/offloading/test_streams.py::test_on_the_accelerator_a_nested_group_comes_through_a_temporary_buffer_in_stream_order",),
    ),
    Mutation(
        "sync: the staging buffer is refilled only once its last copy has read it",
        "src/torchsurgery/offloading/streams.py",
        "                device.synchronize(self.staged)  # the staging", "                pass  # the staging",
        ("tests/offloading/test_device.py::test_streaming_from_a_safetensors_file_on_the_accelerator_through_the_staging_buffer",),
    ),
    Mutation(
        "sync: remove() lets the copies in flight land before the ring's buffers go",
        "src/torchsurgery/offloading/streams.py",
        "        if self.ring is not None:\n            self.device.synchronize()\n", "        if self.ring is not None:\n",
        ("tests/offloading/test_device.py::test_remove_on_the_accelerator_lets_the_copies_in_flight_land_first",),
    ),
    Mutation(
        "sync: the planner remaking the ring lets the copies in flight land before the old ring's buffers go",
        "src/torchsurgery/offloading/streams.py",
        "        if self.ring is not None:\n            self.device.synchronize()\n", "        if self.ring is not None:\n",
        ("tests/offloading/test_device.py::test_the_planner_remaking_the_ring_lets_the_copies_in_flight_land_first",),
    ),
    Mutation(
        "sync: AcceleratorDevice.wait makes the stream wait for the event",
        "src/torchsurgery/_device.py",
        "            stream.wait_event(event)", "            pass",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pinned-lazy]",),
    ),
    Mutation(
        "sync: AcceleratorDevice.record records the event on the stream",
        "src/torchsurgery/_device.py",
        "        event.record(stream)\n", "",
        ("tests/offloading/test_device.py::test_streaming_on_the_accelerator_is_exact_while_copies_land_late[pinned-lazy]",),
    ),
    Mutation(
        "sync: AcceleratorDevice.synchronize blocks the host",
        "src/torchsurgery/_device.py",
        "            what.synchronize()\n        elif not self.host_compute:\n            torch.accelerator.synchronize(self.device)",
        "            pass\n        elif False:\n            pass",
        ("tests/offloading/test_device.py::test_remove_on_the_accelerator_lets_the_copies_in_flight_land_first",),
    ),
    Mutation(
        "sync: a forward's captures in pinned memory have landed when it returns",
        "src/torchsurgery/flex/captures.py",
        "            device.synchronize(stream)", "            pass",
        ("tests/flex/test_captures.py::test_accelerator_captures_are_pinned_and_finished_when_forward_returns",),
    ),
    Mutation(
        "flex: state_dict() holds the trainable modules, under flex_model's keys",
        "src/torchsurgery/flex/state.py",
        "        return self._layout().state_dict(*args, **kwargs)\n",
        "        return self.module.state_dict(*args, **kwargs)\n",
        ("tests/flex/test_model.py::test_a_trained_module_saved_and_loaded_comes_back_bit_for_bit_as_under_flex_model",),
    ),
    Mutation(
        "the command: Ctrl-C is handled from before torch's import",
        "src/_torchsurgery_interrupt.py",
        "    signal.signal(signal.SIGINT, _interrupted)\n", "    pass\n",
        ("tests/cli/test_interrupt.py::test_an_interrupt_at_any_point_is_one_line_exit_130_and_no_partial_file",),
    ),
    Mutation(
        "the command: an interrupt removes the files being written",
        "src/_torchsurgery_interrupt.py",
        "    for path in reversed(_partial):\n", "    for path in []:\n",
        ("tests/cli/test_interrupt.py::test_an_interrupt_removes_what_was_being_written_and_nothing_else",),
    ),
    Mutation(
        "compat: a move keeps preserved_memory_gb free on the device",
        "src/torchsurgery/compat/framepack.py",
        '    keep = None if pool.device.type == "cpu" else int(preserved_memory_gb * _GIB)\n', "    keep = None\n",
        ("tests/compat/test_framepack.py::test_the_memory_functions_leave_the_preserved_memory_free_as_the_app_s_do",),
    ),
    Mutation(
        "compat: an offload takes back what keeping preserved_memory_gb free needs",
        "src/torchsurgery/compat/framepack.py",
        "    keep = int(preserved_memory_gb * _GIB)\n", "    keep = 0\n",
        ("tests/compat/test_framepack.py::test_the_memory_functions_leave_the_preserved_memory_free_as_the_app_s_do",),
    ),
    Mutation(
        "compat: a model shrunk to keep memory free is planned with what its push-back freed, not its grant",
        "src/torchsurgery/offloading/pool.py",
        "        member.push_back()\n        room = self.measured(member, room, keep)\n        handle = member.offload(room, keep) if room >= min",
        "        member.push_back()\n        handle = member.offload(room, keep) if room >= min",
        ("tests/compat/test_framepack.py::test_the_memory_functions_leave_the_preserved_memory_free_as_the_app_s_do",),
    ),
    Mutation(
        "compat: a load planned again counts what the models pushed back freed, not their grants",
        "src/torchsurgery/offloading/pool.py",
        "        room = self.measured(member, room, keep)\n        if room < min(", "        if room < min(",
        ("tests/offloading/test_pool.py::"
         "test_on_the_accelerator_a_model_pushed_back_frees_what_it_held_not_what_it_was_granted",
         "tests/compat/test_framepack.py::test_the_memory_functions_leave_the_preserved_memory_free_as_the_app_s_do"),
    ),
    Mutation(
        "planning: groups read in place, resident from the start, leave room for the ring's prefetch + 1 slots",
        "src/torchsurgery/offloading/plan.py",
        "device_bytes(groups, resident | {g.name}, options.prefetch,", "device_bytes(groups, resident | {g.name}, 0,",
        ("tests/offloading/test_engine.py::"
         "test_groups_read_in_place_are_kept_resident_from_the_start_next_to_the_ring_at_its_prefetch",),
    ),
    Mutation(
        "planning: the residency chosen from the first forward leaves room for the ring's prefetch + 1 slots",
        "src/torchsurgery/offloading/plan.py",
        "device_bytes(self.groups, resident, self.prefetch,", "device_bytes(self.groups, resident, 0,",
        ("tests/offloading/test_engine_edges.py::test_the_device_peak_stays_within_a_budget_at_every_prefetch[3]",),
    ),
    Mutation(
        "planning: plan_residency's own account leaves room for prefetch + 1 of the largest streamed group",
        "src/torchsurgery/offloading/residency.py",
        "(prefetch + 1) * max(rest, default=0) <= budget", "max(rest, default=0) <= budget",
        ("tests/offloading/test_residency.py::test_planner_beats_filling_in_order_and_is_near_the_best_choice",),
    ),
    Mutation(
        "planning: a streamed weight's cast to the compute dtype is counted in the budget",
        "src/torchsurgery/offloading/budgets.py",
        "            per_run += _allocated(p.nbytes, granule)\n", "            pass\n",
        ("tests/offloading/test_engine_edges.py::"
         "test_the_device_peak_stays_within_the_least_budget_when_streamed_weights_are_cast[2]",),
    ),
    Mutation(
        "planning: what a streamed group's run adds (its casts) is counted in the budget",
        "src/torchsurgery/offloading/budgets.py",
        " + max((r for _, r in streamed), default=0) + widened", " + widened",
        ("tests/offloading/test_engine_edges.py::"
         "test_the_device_peak_stays_within_the_least_budget_when_streamed_weights_are_cast[1]",),
    ),
    Mutation(
        "pending backward: the offload's removal gives every weight back at once, also where a graph holds it",
        "src/torchsurgery/offloading/engine.py",
        "            hand_over(tensor, replacement)\n",
        "            torch.utils.swap_tensors(tensor, replacement)\n",
        ("tests/offloading/test_pending.py::test_a_with_block_in_grad_mode_exits_and_the_backward_after_it_reaches_the_restored_weights[bf16]",),
    ),
    Mutation(
        "pending backward: a graph that holds a weight given back is not poisoned",
        "src/torchsurgery/offloading/pending.py",
        "pending_backward_ok=True, poison=not held)", "pending_backward_ok=True, poison=True)",
        ("tests/offloading/test_pending.py::test_a_with_block_in_grad_mode_exits_and_the_backward_after_it_reaches_the_restored_weights[fp64]",),
    ),
    Mutation(
        "pending backward: the gradient a graph gives the offloaded content goes on to the weight given back",
        "src/torchsurgery/offloading/pending.py",
        "        replacement.register_post_accumulate_grad_hook(functools.partial(_hand_on, tensor))\n",
        "        pass\n",
        ("tests/offloading/test_pending.py::test_a_with_block_in_grad_mode_exits_and_the_backward_after_it_reaches_the_restored_weights[scaled]",
         "tests/offloading/test_engine_edges.py::test_remove_gives_the_weights_back_at_once_while_a_backward_is_pending_and_it_reaches_them[least-bf16]"),
    ),
    Mutation(
        "pending backward: the gradient handed on comes on the weight's device, in its dtype",
        "src/torchsurgery/offloading/pending.py",
        "    grad = grad.to(device=owner.device, dtype=owner.dtype)\n", "",
        ("tests/offloading/test_engine_edges.py::test_remove_gives_the_weights_back_at_once_while_a_backward_is_pending_and_it_reaches_them[whole-same-dtype]",
         "tests/offloading/test_pending.py::test_a_conversion_while_a_backward_is_pending_hands_its_gradients_on_to_the_converted_weights"),
    ),
    Mutation(
        "pending backward: a gradient that went back with its weight is not counted again by the graph's next backward",
        "src/torchsurgery/offloading/pending.py",
        "        replacement.grad = None\n", "",
        ("tests/offloading/test_pending.py::test_a_graph_kept_past_the_block_backwards_again_and_differentiates_its_input",),
    ),
    Mutation(
        "pending backward: the gradient handed on adds to the weight's own",
        "src/torchsurgery/offloading/pending.py",
        "        owner.grad += grad\n", "        owner.grad = grad\n",
        ("tests/offloading/test_pending.py::test_a_graph_kept_past_the_block_backwards_again_and_differentiates_its_input",),
    ),
    Mutation(
        "pending backward: with create_graph the gradient handed on adds out of place",
        "src/torchsurgery/offloading/pending.py",
        "    elif torch.is_grad_enabled():", "    elif False:",
        ("tests/offloading/test_pending.py::test_a_gradient_penalty_after_the_block_differentiates_the_gradients_as_the_plain_model",),
    ),
    Mutation(
        "pending backward: a conversion hands a pending graph's gradient on to the weights it converts",
        "src/torchsurgery/offloading/conversion.py",
        "hand_over(t, wrap_like(t, t.detach().to(read_as).to(dtype)))",
        '__import__("torchsurgery._swap", fromlist=["swap_in"]).swap_in('
        "t, wrap_like(t, t.detach().to(read_as).to(dtype)), pending_backward_ok=True)",
        ("tests/offloading/test_pending.py::test_a_conversion_while_a_backward_is_pending_hands_its_gradients_on_to_the_converted_weights",),
    ),
    # models streamed from their checkpoint files in the FramePack functions
    Mutation(
        "framepack files: a streamed model with no room on the device goes on computing on the host",
        "src/torchsurgery/compat/framepack.py",
        "        _to_host(model)  # not even one module fits: it computes on the host, from its files\n",
        "        pass\n",
        ("tests/compat/test_framepack_streamed.py::"
         "test_a_streamed_model_moved_partly_keeps_its_own_host_budget_and_with_no_room_stays_on_the_host",),
    ),
    Mutation(
        'framepack files: a streamed model taken out of the shared pool gets its base back (it runs on the host from its files)',
        'src/torchsurgery/compat/framepack.py',
        '        _streamed.put_back(model)  # streamed from its files: back to computing on the host from them\n',
        '        pass\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[roomy]',),
    ),
    Mutation(
        'framepack files: a streamed model joins the shared pool streaming from its own files',
        'src/torchsurgery/compat/framepack.py',
        '        pool.add(model, **_streamed.take_off(model))  # streamed: from the same files\n',
        '        pool.add(model)\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[roomy]',),
    ),
    Mutation(
        'framepack files: a streamed model moved to a CPU target stays as it is (nothing materialised in host memory)',
        'src/torchsurgery/compat/framepack.py',
        '    if target.type == "cpu" and _streamed.on_host(model):\n        return  # streamed',
        '    if False:\n        return  # streamed',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading',),
    ),
    Mutation(
        'framepack files: a streamed model loaded as complete on a CPU target stays as it is',
        'src/torchsurgery/compat/framepack.py',
        '    if target.type != "cpu" or not _streamed.on_host(model):',
        '    if True:',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading',),
    ),
    Mutation(
        'framepack files: a streamed model is not moved by hand to the host (its weights are in its files)',
        'src/torchsurgery/compat/framepack.py',
        '    elif not _streamed.streamed(model):  # a streamed model holds no weights to move\n',
        '    else:\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading',),
    ),
    Mutation(
        "framepack files: fake_diffusers_current_device leaves a streamed model's meta weights alone",
        'src/torchsurgery/compat/framepack.py',
        ' and not _streamed.streamed(model):',
        ':',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading',),
    ),
    Mutation(
        'framepack files: the installer on a streamed model makes its base an offload to the device',
        'src/torchsurgery/compat/_streamed.py',
        '        _replace_base(model, _installer_base(model, device, kwargs))\n',
        '        _Installer.install_model(model, **kwargs)\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[low-vram]',),
    ),
    Mutation(
        "framepack files: uninstalling puts a streamed model's host base back",
        'src/torchsurgery/compat/_streamed.py',
        '        _replace_base(model, Base(host.device, host.options))\n',
        '        pass\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[low-vram]',),
    ),
    Mutation(
        'framepack files: a streamed model keeps its own host budget in the shared pool',
        'src/torchsurgery/compat/_streamed.py',
        '"storage", "host_budget")',
        '"storage")',
        ('tests/compat/test_framepack_streamed.py::test_a_streamed_model_moved_partly_keeps_its_own_host_budget_and_with_no_room_stays_on_the_host',),
    ),
    Mutation(
        'framepack files: DevicePool.add(host_budget=) gives a model its own host budget',
        'src/torchsurgery/offloading/pool.py',
        '"host_budget": self.host if host_budget is None else _host_account(host_budget)}',
        '"host_budget": self.host}',
        ('tests/compat/test_framepack_streamed.py::test_a_streamed_model_moved_partly_keeps_its_own_host_budget_and_with_no_room_stays_on_the_host',),
    ),
    Mutation(
        'framepack files: a model streamed from a file takes .to(dtype)',
        'src/torchsurgery/offloading/conversion.py',
        '    running = [name for name, streamer in streamers.items() if streamer.depth > 0]\n',
        '    if plan.storage is not None:\n        raise RuntimeError("refused")\n    running = [name for name, streamer in streamers.items() if streamer.depth > 0]\n',
        ('tests/offloading/test_engine_edges.py::test_a_model_streamed_from_a_file_takes_to_dtype_as_the_plain_model',),
    ),
    Mutation(
        'framepack files: the .to(dtype) guard probes a weight stored meta with a stand-in',
        'src/torchsurgery/compact/stored.py',
        ' if stored_values(t).is_meta and not t.is_meta else t\n',
        ' if False else t\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[low-vram]',),
    ),
    Mutation(
        'framepack files: nn.MultiheadAttention is one offload group with the out_proj it reads',
        'src/torchsurgery/offloading/grouping.py',
        '    return _split_uncalled(named, _whole_readers(named, found))\n',
        '    return _split_uncalled(named, found)\n',
        ('tests/offloading/test_grouping.py::test_a_module_reading_its_childrens_weights_is_one_group_with_them', 'tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading'),
    ),
    Mutation(
        'framepack files: read buffers allocated under inference_mode are normal tensors (the reader threads write them)',
        'src/torchsurgery/offloading/file_reader.py',
        '        self._allocate = _normal_tensors(device.pinned_empty if pinned else lambda n: torch.empty(n, dtype=torch.uint8))\n',
        '        self._allocate = device.pinned_empty if pinned else lambda n: torch.empty(n, dtype=torch.uint8)\n',
        ('tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading',),
    ),
    # the host tier and the reads of weights streamed from a checkpoint
    Mutation(
        "host tier: a read buffer is reused only once the device copy that read it has landed",
        "src/torchsurgery/offloading/file_reader.py",
        "                self._device.synchronize(copied)  # the copy that read it has landed\n",
        "                pass\n",
        ("tests/offloading/test_file_reader.py::test_read_ahead_across_forwards_is_exact_under_the_test_device_delays",),
    ),
    Mutation(
        "host tier: a read started ahead is waited for before its group computes",
        "src/torchsurgery/offloading/file_reader.py",
        "        concurrent.futures.wait(read.futures)\n        for future in read.futures:\n",
        "        for future in [f for f in read.futures if f.done()]:\n",
        ("tests/offloading/test_file_reader.py::test_direct_and_buffered_reads_give_the_file_bytes",
         "tests/offloading/test_host_tier.py::test_the_host_keeps_the_groups_read_first_within_its_budget_and_reads_the_rest_every_forward"),
    ),
    Mutation(
        "host tier: the reads of the next forward start before this one ends (read-ahead wraps around the order)",
        "src/torchsurgery/offloading/file_reader.py",
        "            following = self._order.ahead(name, len(recorded)) + recorded\n",
        "            following = self._order.ahead(name, len(recorded))\n",
        ("tests/offloading/test_file_reader.py::test_read_ahead_across_forwards_is_exact_under_the_test_device_delays",),
    ),
    Mutation(
        "host tier: the budget an account has lent to one model is not planned for another",
        "src/torchsurgery/offloading/host_tier.py",
        "            return self.budget - sum(self._held.values())\n",
        "            return self.budget\n",
        ("tests/offloading/test_host_tier.py::test_models_offloaded_with_one_host_account_share_its_budget",),
    ),
    Mutation(
        "host tier: removing an offload gives its host bytes back to the account",
        "src/torchsurgery/offloading/file_reader.py",
        "        self._account.release(self)\n\n    def _start",
        "        pass\n\n    def _start",
        ("tests/offloading/test_host_tier.py::test_models_offloaded_with_one_host_account_share_its_budget",),
    ),
    Mutation(
        "host tier: groups of the host tier are kept once read, not read again",
        "src/torchsurgery/offloading/file_reader.py",
        "        if read is None and name in self._kept:\n",
        "        if False:\n",
        ("tests/offloading/test_host_tier.py::test_the_host_keeps_the_groups_read_first_within_its_budget_and_reads_the_rest_every_forward",),
    ),
    Mutation(
        "direct I/O: the aligned read is trimmed to each tensor's bytes",
        "src/torchsurgery/offloading/file_reader.py",
        ".copy_(bounce[first - lo : last - lo])",
        ".copy_(bounce[first - piece.start : last - piece.start])",
        ("tests/offloading/test_file_reader.py::test_direct_and_buffered_reads_give_the_file_bytes",),
    ),
    Mutation(
        "host tier: a read error is raised in the forward that needs the group",
        "src/torchsurgery/offloading/file_reader.py",
        "                self._recycle(read)\n                raise error\n",
        "                self._recycle(read)\n",
        ("tests/offloading/test_file_reader.py::test_a_failed_read_surfaces_in_the_forward_that_needs_it_naming_the_file",
         "tests/offloading/test_file_reader.py::test_an_io_error_in_a_read_thread_names_the_file"),
    ),
    Mutation(
        "host tier: remove() waits for the reads in flight",
        "src/torchsurgery/offloading/file_reader.py",
        "        for read in self._flight.values():\n            concurrent.futures.wait(read.futures)\n        self._pool.shutdown(wait=True)\n",
        "        self._pool.shutdown(wait=False)\n",
        ("tests/offloading/test_file_reader.py::test_remove_with_a_read_in_flight_waits_for_it_and_restores_the_model",),
    ),
    # from_pretrained and checkpoint faults
    Mutation(
        'from_pretrained: the model is built as a skeleton, never materialised in memory',
        'src/torchsurgery/offloading/pretrained.py',
        "        with skeleton():  # the library's default: the config's dtype (the checkpoint's)\n", '        if True:\n',
        ('tests/offloading/test_pretrained.py::test_peak_memory_stays_two_groups_above_the_start[83MB]',),
    ),
    Mutation(
        "from_pretrained: buffers left out of the checkpoint are computed by the model's __init__",
        'src/torchsurgery/offloading/pretrained.py',
        "        with skeleton():  # the library's default: the config's dtype (the checkpoint's)\n", '        with skeleton(include_buffers=True):\n',
        ('tests/offloading/test_pretrained.py::test_llama_folder_gives_the_library_s_outputs[tied-file-dtype]',),
    ),
    Mutation(
        "from_pretrained: the folder's generation config is read",
        'src/torchsurgery/offloading/pretrained.py',
        '        if generation.is_file() and', '        if False and',
        ('tests/offloading/test_pretrained.py::test_llama_folder_gives_the_library_s_outputs[tied-file-dtype]',),
    ),
    Mutation(
        'from_pretrained: the model is returned in eval mode',
        'src/torchsurgery/offloading/pretrained.py',
        '    return model.eval()\n', '    return model\n',
        ('tests/offloading/test_pretrained.py::test_llama_folder_gives_the_library_s_outputs[tied-file-dtype]',),
    ),
    Mutation(
        'from_pretrained: keywords that are no config attribute are refused',
        'src/torchsurgery/offloading/pretrained.py',
        '    if unused:\n', '    if False:\n',
        ('tests/offloading/test_pretrained.py::test_bad_input_is_refused_clearly',),
    ),
    Mutation(
        "from_pretrained: diffusers' checkpoint names are looked for",
        'src/torchsurgery/offloading/pretrained.py',
        '    "diffusion_pytorch_model.safetensors.index.json",\n', '',
        ('tests/offloading/test_pretrained.py::test_unet_in_a_diffusers_subfolder',),
    ),
    Mutation(
        'from_pretrained: host_budget is refused clearly while offload has no host tier',
        'src/torchsurgery/offloading/pretrained.py',
        '        if "host_budget" not in inspect.signature(offload).parameters:\n', '        if False:\n',
        ('tests/offloading/test_pretrained.py::test_host_budget_is_refused_while_offload_has_no_host_tier',),
    ),
    Mutation(
        'checkpoint faults: what was read from a file changed since it was opened is refused',
        'src/torchsurgery/_checkpoint.py',
        '        if check:\n            self.check_unchanged(', '        if False:\n            self.check_unchanged(',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[rewrite-skeleton]',),
    ),
    Mutation(
        "checkpoint faults: a write in place is seen by the file's modification time",
        'src/torchsurgery/_checkpoint.py',
        '    if now.mtime_ns != opened.mtime_ns:\n', '    if False:\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[rewrite-skeleton]',),
    ),
    Mutation(
        'checkpoint faults: a file cut short says how its size changed',
        'src/torchsurgery/_checkpoint.py',
        '    if now.size != opened.size:\n', '    if False:\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_truncated_in_the_middle_of_a_forward[skeleton]',),
    ),
    Mutation(
        'checkpoint faults: a deleted file is reported',
        'src/torchsurgery/_checkpoint.py',
        '        return "it was deleted (the open file still holds the original bytes)"\n', '        return None\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[delete-skeleton]',),
    ),
    Mutation(
        'checkpoint faults: a file replaced by another is reported',
        'src/torchsurgery/_checkpoint.py',
        '    if (named.device, named.inode) != (opened.device, opened.inode):\n', '    if False:\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[replace-skeleton]',),
    ),
    Mutation(
        'checkpoint faults: an I/O error names the file and the key',
        'src/torchsurgery/_checkpoint.py',
        '        except OSError as exc:  # the disk, the network filesystem', '        except ValueError as exc:  # the disk, the network filesystem',
        ('tests/offloading/test_checkpoint_faults.py::test_an_io_error_names_the_file_and_key[skeleton]',),
    ),
    Mutation(
        'checkpoint faults: remove() gives back only the values the file held at the start',
        'src/torchsurgery/offloading/checkpoint_values.py',
        '        if key in self.checksums and _checksum(values) != self.checksums[key]:\n', '        if False:\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[rewrite-own-values]',),
    ),
    Mutation(
        "checkpoint faults: remove() reads the original a deleted file's open descriptor keeps",
        'src/torchsurgery/offloading/checkpoint_values.py',
        '        values = self.read(key, check=False)\n', '        values = self.read(key)\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_shard_changed_between_forwards[delete-own-values]',),
    ),
    Mutation(
        'checkpoint faults: an index entry whose file lies out of the folder is refused',
        'src/torchsurgery/_checkpoint.py',
        '    return target if target.parent in homes else None\n', '    return target\n',
        ('tests/offloading/test_checkpoint_faults.py::test_index_entries_leading_out_of_the_folder_are_refused[symlink-out]', 'tests/offloading/test_checkpoint_faults.py::test_index_entries_leading_out_of_the_folder_are_refused[absolute]', 'tests/offloading/test_checkpoint_faults.py::test_index_entries_leading_out_of_the_folder_are_refused[dotdot]'),
    ),
    Mutation(
        "checkpoint faults: a hub cache snapshot reads its repository's blobs",
        'src/torchsurgery/_checkpoint.py',
        '        homes.add(folder.resolve().parent.parent / "blobs")\n', '        pass\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_hugging_face_cache_snapshot_is_read',),
    ),
    Mutation(
        "checkpoint faults: a folder's checkpoint linked from outside it is refused",
        'src/torchsurgery/_checkpoint.py',
        '                if _entry_of(path, candidate) is None:\n', '                if False:\n',
        ('tests/offloading/test_checkpoint_faults.py::test_a_folder_s_checkpoint_linked_from_outside_is_refused',),
    ),
    Mutation(
        'checkpoint faults: reads far slower than a local disk give a hint',
        'src/torchsurgery/offloading/stats.py',
        'or nbytes / seconds >= SLOW_STORAGE:', 'or True:',
        ('tests/offloading/test_checkpoint_faults.py::test_a_slow_filesystem_is_named_in_the_hint[slow]',),
    ),
    Mutation(
        'checkpoint faults: the hint joins stats() of a model streamed from a file',
        'src/torchsurgery/offloading/engine.py',
        '        stats.hint = "; ".join(h for h in (stats.hint, slow) if h)\n', '',
        ('tests/offloading/test_checkpoint_faults.py::test_a_slow_filesystem_is_named_in_the_hint[slow]',),
    ),
    # every scaled format under the op_db sweep; torch.export and torchao with an offload
    Mutation(
        "composes: as_strided_ and resize_ of a scaled weight take the same view of its scale",
        "src/torchsurgery/compact/tensor.py",
        "        scale = scale_laid_out_as(scale, t.stored) if laid_out else _aten.alias.default(scale)\n",
        "        scale = _aten.alias.default(scale)\n",
        ("tests/compact/test_conformance.py::test_inplace_op_on_the_weight_is_the_op_on_the_plain_parameter[resize_-float8_e4m3fn-channel]",
         "tests/compact/test_conformance.py::test_inplace_op_on_the_weight_is_the_op_on_the_plain_parameter[as_strided_partial_views-float8_e5m2-tensor]"),
    ),
    Mutation(
        "composes: torch.export's fakifier sees an offloaded weight's own storage",
        "src/torchsurgery/compact/tensor_api.py",
        "    if described_for_fakes():", "    if False:",
        ("tests/compact/test_export.py::test_the_exported_program_computes_as_the_plain_model[bf16]",
         "tests/compact/test_export.py::test_the_exported_program_computes_as_the_plain_model[int8-channel]"),
    ),
    Mutation(
        "composes: a streamed group traces with the weights torch.export puts in their place",
        "src/torchsurgery/offloading/streams.py",
        "            current = [owner._parameters[pname] for owner, pname, _, _ in entries]\n",
        "            current = [p for _, _, p, _ in entries]\n",
        ("tests/compact/test_export.py::test_the_exported_program_computes_as_the_plain_model[streamed]",
         "tests/compact/test_export.py::test_groups_streamed_to_the_accelerator_export[fp8-scaled]"),
    ),
    Mutation(
        "composes: a group streamed from a checkpoint file is refused under torch.export",
        "src/torchsurgery/offloading/streams.py",
        "        if not streamer.traceable:\n            refuse_file_export(streamer.name)\n", "",
        ("tests/compact/test_export.py::test_a_model_streamed_from_a_checkpoint_file_is_refused_as_it_was",),
    ),
    Mutation(
        "composes: a weight of another library's tensor subclass (torchao) is kept as it is",
        "src/torchsurgery/offloading/plan.py",
        "floating = p.is_floating_point() and not foreign_subclass(p)", "floating = p.is_floating_point()",
        ("tests/compact/test_foreign.py::test_torchao_weights_are_kept_as_they_are_and_the_rest_stored_as_asked[bf16]",),
    ),
    Mutation(
        "fallback: without a budget of the user's, groups too large fall back to finer ones",
        "src/torchsurgery/offloading/plan.py",
        "    for step, finer in _finer(options):\n", "    for step, finer in []:\n",
        ("tests/offloading/test_fallback.py::test_without_a_budget_blocks_too_large_for_the_free_memory_stream_as_single_modules",
         "tests/offloading/test_fallback.py::test_a_pool_without_a_budget_streams_single_modules_where_its_room_is_too_small"),
    ),
    Mutation(
        "fallback: an explicit budget below the chosen groups is still refused",
        "src/torchsurgery/offloading/plan.py",
        "    if fallback is None and budget is None and not options.device.host_compute:\n",
        "    if fallback is None:\n",
        ("tests/offloading/test_fallback.py::test_an_explicit_budget_below_the_blocks_is_still_refused",),
    ),
    Mutation(
        "fallback: only a single weight too large is refused, naming it and the least budget",
        "src/torchsurgery/offloading/plan.py",
        "    raise least_refused(groups, last, options, buffers)\n", "    raise last\n",
        ("tests/offloading/test_fallback.py::test_without_a_budget_only_a_single_weight_too_large_is_refused_naming_it",),
    ),
    Mutation(
        "fallback: a pool without a budget loads a model whose room holds only its finest plan",
        "src/torchsurgery/offloading/pool_members.py",
        "        return self.least if self.fallback is not None else self.streamed\n",
        "        return self.streamed\n",
        ("tests/offloading/test_fallback.py::test_a_pool_without_a_budget_streams_single_modules_where_its_room_is_too_small",
         "tests/compat/test_framepack.py::test_too_little_memory_for_the_transformer_s_blocks_runs_as_the_app_s_own_module[modules]"),
    ),
    Mutation(
        "fallback: a conversion is checked with the converted weights in their new dtype (no refusal for a cast it will not make)",
        "src/torchsurgery/offloading/plan.py",
        "                own = converted.get(id(p), p.dtype) if converted is not None else p.dtype\n",
        "                own = p.dtype\n",
        ("tests/offloading/test_fallback.py::"
         "test_a_conversion_within_an_explicit_budget_that_holds_the_converted_model_is_taken",),
    ),
    Mutation(
        "compat: the shared pools print, in the app's style, the finer groups a model streams",
        "src/torchsurgery/compat/framepack.py",
        "DevicePool(target, on_fallback=_say_finer)", "DevicePool(target)",
        ("tests/compat/test_framepack.py::test_too_little_memory_for_the_transformer_s_blocks_runs_as_the_app_s_own_module[modules]",),
    ),
    # the host tier and the reads of weights streamed from a checkpoint
    Mutation(
        "direct I/O: reads start at an offset aligned to 4096 bytes",
        "src/torchsurgery/offloading/file_reader.py",
        "    lo = piece.start - piece.start % _ALIGN\n",
        "    lo = piece.start\n",
        ("tests/offloading/test_file_reader.py::test_direct_and_buffered_reads_give_the_file_bytes",),
    ),
    Mutation(
        "budget='least': a conversion plans the model at its new least (FramePack's installer on a streamed model)",
        "src/torchsurgery/compat/_streamed.py",
        '    return Base(device, {**options, "budget": "least"})\n',
        '    return Base(device, {**options, "budget": plan_offload(model, device, **{**options, "budget": None}).budget})\n',
        ("tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[low-vram]",),
    ),
    Mutation(
        "budget='least': resolved to the least budget the model takes, planned again at each conversion",
        "src/torchsurgery/offloading/plan.py",
        '    if budget == "least":\n', '    if False:\n',
        ("tests/offloading/test_engine_edges.py::test_budget_least_streams_every_group_and_follows_the_model_through_a_conversion",),
    ),
    Mutation(
        "threads (issue 48): a conversion holds the forward lock, so it waits for the forwards running and they for it",
        "src/torchsurgery/offloading/conversion.py",
        "        if self.lock is None:\n            return self._apply(fn, recurse)\n",
        "        if True:\n            return self._apply(fn, recurse)\n",
        ("tests/offloading/test_forward_lock.py::test_a_conversion_waits_for_the_forward_running_in_another_thread",),
    ),
    Mutation(
        "threads (issue 48): a forward lock held by a thread that ended is taken over",
        "src/torchsurgery/offloading/forward_lock.py",
        "        if not owner.is_alive():\n            return True\n",
        "",
        ("tests/offloading/test_forward_lock.py::"
         "test_a_forward_that_ended_its_thread_or_raised_does_not_keep_the_next_forwards_waiting",),
    ),
    Mutation(
        "threads (issue 48): a forward lock whose holder left the forward it took it for is taken over",
        "src/torchsurgery/offloading/forward_lock.py",
        "                if frame.f_code is _CALL and frame.f_locals.get(\"self\") is self._forward:\n                    return False\n",
        "                return False\n",
        ("tests/offloading/test_forward_lock.py::"
         "test_a_forward_interrupted_in_a_thread_that_goes_on_does_not_keep_the_next_forwards_waiting",),
    ),
    Mutation(
        "threads (issue 48): a conversion keeps the forward lock, which the forwards waiting for it hold next",
        "src/torchsurgery/offloading/engine.py",
        "            self._streaming.lock = lock\n",
        "",
        ("tests/offloading/test_forward_lock.py::test_conversions_racing_forwards_in_threads_never_half_change_the_model",),
    ),
]


def run(mutation: Mutation) -> tuple[str, float]:
    """Apply, test, restore: 'caught', 'SURVIVED' or 'STALE' (the source no longer matches)."""
    path = ROOT / mutation.path
    source = path.read_text(encoding="utf-8")
    if source.count(mutation.old) != 1:
        return "STALE", 0.0
    start = time.perf_counter()
    try:
        path.write_text(source.replace(mutation.old, mutation.new), encoding="utf-8")
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT, capture_output=True, text=True,
        )
    finally:
        path.write_text(source, encoding="utf-8")
    return ("caught" if done.returncode != 0 else "SURVIVED"), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only in m.name]
    failed = False
    for m in chosen:
        if args.list:
            print(f"{m.name}: {m.path} -> {', '.join(m.tests)}")
            continue
        verdict, seconds = run(m)
        failed |= verdict != "caught"
        print(f"{verdict:9} {seconds:6.1f}s  {m.name}  ({m.path}; {', '.join(t.rsplit('::', 1)[-1] for t in m.tests)})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
