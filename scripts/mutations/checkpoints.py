"""Mutations of loading and streaming checkpoints: tensors.load_, from_pretrained, file faults (run by scripts/mutate.py)."""

from mutations.base import Mutation

MUTATIONS = [
    Mutation(
        "checkpoints: ComfyUI's comfy_quant layers (weight_scale) are read as scaled fp8",
        "src/torchsurgery/_checkpoint.py",
        '_SCALE_KEYS, _INPUT_SCALE_KEYS = ("scale_weight", "weight_scale"), ("scale_input", "input_scale")\n',
        '_SCALE_KEYS, _INPUT_SCALE_KEYS = ("scale_weight",), ("scale_input", "input_scale")\n',
        ("tests/compact/test_comfy_checkpoint.py::test_comfy_quant_layers_load_into_a_plain_model_as_comfyui_dequantises_them",),
    ),
    Mutation(
        "scaled: a load of plain values chooses a new scale from them",
        "src/torchsurgery/tensors/loading.py",
        "        plain_values = {id(t): torch.empty(t.shape, dtype=t.dtype) for t, _ in run if own_scale(t) is not None}\n",
        "        plain_values: dict[int, torch.Tensor] = {}\n",
        ("tests/compact/test_scaled.py::test_load_of_plain_values_chooses_a_scale_from_them",),
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
]
