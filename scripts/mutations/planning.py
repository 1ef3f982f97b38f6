"""Mutations of planning: budgets, residency, groups, pools and statistics (run by scripts/mutate.py)."""

from mutations.base import Mutation

MUTATIONS = [
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
        "a conversion's check plans the offload's own weights as the plain tensors they will be",
        "src/torchsurgery/offloading/plan.py",
        " or reads_elsewhere_only(t) or _undo.holder_of_any([t]) is not None\n",
        " or reads_elsewhere_only(t)\n",
        ("tests/offloading/test_engine_edges.py::test_a_conversion_the_least_budget_cannot_hold_is_refused_before_anything_changes",),
    ),
    Mutation(
        "offload refuses a part of a model offloaded whole",
        "src/torchsurgery/offloading/plan.py",
        "    holder = _undo.holder_of_any(model.parameters())\n",
        "    holder = None\n",
        ("tests/offloading/test_engine_edges.py::test_an_offload_of_a_part_of_an_offloaded_model_is_refused_before_anything_changes",),
    ),
    Mutation(
        "scaled: a weight with an inf or NaN is refused at offload",
        "src/torchsurgery/offloading/plan.py",
        "        if bad:\n            raise ArgumentValueError(\n                _WHAT, \"storage_dtype\", p.scaled,\n",
        "        if False:\n            raise ArgumentValueError(\n                _WHAT, \"storage_dtype\", p.scaled,\n",
        ("tests/compact/test_scaled.py::test_a_weight_with_an_inf_or_nan_is_refused_by_name_and_the_model_is_left_as_it_was",),
    ),
    Mutation(
        "a budget counts the ring's prefetch + 1 slots",
        "src/torchsurgery/offloading/budgets.py",
        "return buffers + held + (prefetch + 1) * slot + max((r for _, r in streamed), default=0) + widened",
        "return buffers + held + slot + max((r for _, r in streamed), default=0) + widened",
        ("tests/offloading/test_engine_edges.py::test_the_device_peak_stays_within_a_budget_at_every_prefetch[3]",),
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
        "a patch that reads weight memory directly keeps its module from narrow storage",
        "src/torchsurgery/offloading/plan.py",
        "    _check_plain_readers(named, groups)\n", "",
        ("tests/offloading/test_engine.py::test_a_patch_that_cannot_serve_narrow_weights_is_refused_in_either_order",),
    ),
    Mutation(
        "a master dtype must hold the values of the weights it keeps",
        "src/torchsurgery/offloading/plan.py",
        "                    _check_master_holds(master_dtype, name, stored_values(p).dtype)  # the values as kept\n", "",
        ("tests/offloading/test_plan.py::test_a_master_dtype_must_hold_the_weights_values_exactly"
         "[torch.float32-torch.bfloat16-torch.float8_e4m3fn-False]",),
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
        'framepack files: DevicePool.add(host_budget=) gives a model its own host budget',
        'src/torchsurgery/offloading/pool.py',
        '"host_budget": self.host if host_budget is None else _host_account(host_budget)}',
        '"host_budget": self.host}',
        ('tests/compat/test_framepack_streamed.py::test_a_streamed_model_moved_partly_keeps_its_own_host_budget_and_with_no_room_stays_on_the_host',),
    ),
    Mutation(
        'framepack files: nn.MultiheadAttention is one offload group with the out_proj it reads',
        'src/torchsurgery/offloading/grouping.py',
        '    return _split_uncalled(named, _whole_readers(named, found))\n',
        '    return _split_uncalled(named, found)\n',
        ('tests/offloading/test_grouping.py::test_a_module_reading_its_childrens_weights_is_one_group_with_them', 'tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading'),
    ),
    Mutation(
        'checkpoint faults: reads far slower than a local disk give a hint',
        'src/torchsurgery/offloading/stats.py',
        'or nbytes / seconds >= SLOW_STORAGE:', 'or True:',
        ('tests/offloading/test_checkpoint_faults.py::test_a_slow_filesystem_is_named_in_the_hint[slow]',),
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
        "    if fallback is None and no_budget and not options.device.host_compute:\n",
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
        "budget='least': resolved to the least budget the model takes, planned again at each conversion",
        "src/torchsurgery/offloading/plan.py",
        '    if budget == "least":\n', '    if False:\n',
        ("tests/offloading/test_engine_edges.py::test_budget_least_streams_every_group_and_follows_the_model_through_a_conversion",),
    ),
    Mutation(
        "host fallback: without a host budget of the user's, blocks whose read buffers the host cannot hold stream finer",
        "src/torchsurgery/offloading/host_fit.py",
        "    for taken, make in finer:  # coarsest first", "    for taken, make in []:  # coarsest first",
        ("tests/offloading/test_host_fit.py::test_without_a_host_budget_blocks_whose_buffers_the_host_cannot_hold_stream_as_single_modules[cpu]",
         "tests/offloading/test_host_fit.py::test_a_pool_without_a_host_budget_reports_the_finer_groups_through_on_fallback",
         "tests/offloading/test_host_fit.py::"
         "test_from_pretrained_without_a_host_budget_streams_single_modules_where_the_host_cannot_hold_its_layers"),
    ),
    Mutation(
        "host fallback: only a single weight the host cannot hold is refused, naming it",
        "src/torchsurgery/offloading/host_fit.py",
        "    if need > available:\n        raise _too_small(", "    if False:\n        raise _too_small(",
        ("tests/offloading/test_host_fit.py::test_without_a_host_budget_a_single_weight_the_host_cannot_hold_is_refused_naming_it",),
    ),
    Mutation(
        "host fallback: with the user's host budget, buffers beyond the memory available are refused",
        "src/torchsurgery/offloading/host_fit.py",
        "        if need > available:\n            raise _refused(", "        if False:\n            raise _refused(",
        ("tests/offloading/test_host_fit.py::test_an_explicit_host_budget_keeps_the_chosen_groups_and_refuses_only_buffers_beyond_what_is_available",),
    ),
    Mutation(
        "host fallback: the user's host budget keeps the chosen groups",
        "src/torchsurgery/offloading/plan.py",
        "    if host_fallback is None and host_budget is None:\n", "    if host_fallback is None:\n",
        ("tests/offloading/test_host_fit.py::test_an_explicit_host_budget_keeps_the_chosen_groups_and_refuses_only_buffers_beyond_what_is_available",),
    ),
    Mutation(
        "host fallback: the read buffers come first, the host tier keeps groups in what they leave",
        "src/torchsurgery/offloading/host_fit.py",
        "        return placed, min(keep, room - need)\n", "        return placed, keep\n",
        ("tests/offloading/test_host_tier.py::"
         "test_without_a_host_budget_the_host_keeps_what_is_available_less_a_margin_and_the_read_buffers",),
    ),
    Mutation(
        "host fallback: no read buffer is counted where the host keeps every streamed group",
        "src/torchsurgery/offloading/host_fit.py",
        "if p.tied_to is None) <= room:\n        return 0\n", "if p.tied_to is None) < 0:\n        return 0\n",
        ("tests/offloading/test_host_fit.py::test_without_a_host_budget_a_model_the_host_can_keep_whole_keeps_its_blocks",),
    ),
    Mutation(
        "host fallback: a pool without a host budget tells its on_fallback",
        "src/torchsurgery/offloading/pool.py",
        "member.host_fallback = self._host_fallback(member) if host_budget", "member.host_fallback = None if host_budget",
        ("tests/offloading/test_host_fit.py::test_a_pool_without_a_host_budget_reports_the_finer_groups_through_on_fallback",),
    ),
    Mutation(
        "host fallback: the reader makes no more read buffers than the host's need counts",
        "src/torchsurgery/offloading/engine.py",
        "                                      read_buffers(plan.prefetch, plan.offload_device.host_compute), functools", "                                      plan.prefetch + 3, functools",
        ("tests/offloading/test_host_fit.py::test_the_reader_makes_no_more_than_the_host_need_counts",),
    ),
    Mutation(
        "host fallback: a group converted as it is read needs read buffers of the file's bytes",
        "src/torchsurgery/offloading/host_fit.py",
        "    streamed = [(_read_size(g), streaming_bytes(g)[1]) for g in _streamed(groups)]\n",
        "    streamed = [streaming_bytes(g) for g in _streamed(groups)]\n",
        ("tests/offloading/test_host_fit.py::test_the_reader_makes_no_more_than_the_host_need_counts[tardy-converted-as-read]",),
    ),
]
