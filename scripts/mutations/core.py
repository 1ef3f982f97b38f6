"""Mutations of undo, patching, swaps, the command line and flex (run by scripts/mutate.py)."""

from mutations.base import Mutation

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
        "a patch that passes its arguments on shows the signature of the forward it passes to",
        "src/torchsurgery/patching.py",
        "forward = _passing_on(patch_cls)", "forward = None",
        ("tests/test_invisible_surgery.py::test_generate_passes_logits_to_keep_through_a_class_swap",),
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
]
