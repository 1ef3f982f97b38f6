"""Mutations of the drop-in modules (FramePack's memory functions), also streamed from files (run by scripts/mutate.py)."""

from mutations.base import Mutation

MUTATIONS = [
    Mutation(
        "compat prints FramePack's lines",
        "src/torchsurgery/compat/framepack.py",
        "    if verbose:\n        print(line)",
        "    pass",
        ("tests/compat/test_framepack.py::test_the_app_pattern_in_its_dtypes_equals_the_app_s_own_memory_module",),
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
        "compat: the shared pools print, in the app's style, the finer groups a model streams",
        "src/torchsurgery/compat/framepack.py",
        "DevicePool(target, on_fallback=_say_finer)", "DevicePool(target)",
        ("tests/compat/test_framepack.py::test_too_little_memory_for_the_transformer_s_blocks_runs_as_the_app_s_own_module[modules]",),
    ),
    Mutation(
        "budget='least': a conversion plans the model at its new least (FramePack's installer on a streamed model)",
        "src/torchsurgery/compat/_streamed.py",
        '    return Base(device, {**options, "budget": "least"})\n',
        '    return Base(device, {**options, "budget": plan_offload(model, device, **{**options, "budget": None}).budget})\n',
        ("tests/compat/test_framepack_streamed.py::test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading[low-vram]",),
    ),
]
