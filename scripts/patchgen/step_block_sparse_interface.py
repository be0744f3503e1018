"""Patch 0006's edits to upstream's interface.py: `_flash_attn_fwd` on SM120 hands `block_sparse_tensors`
to the TMA forward with a config whose tile divides the sparse block, and `_flash_attn_bwd` on SM120 builds
the block-sparse backward (FlashAttentionBackwardSm120BlockSparse) with the lifted plan and refusals.
Each edit is (what, old, new); `step_block_sparse.py` applies them (core.apply_edits) and writes the patch.
"""

from __future__ import annotations


_BS_INTERFACE_EDITS = (
    (
        "import of the SM120 block-sparse config helpers",
        "    sm120_tma_varlen_ok,\n"
        ")\n",
        "    sm120_tma_varlen_ok,\n"
        ")\n"
        "from flash_attn.cute.flash_fwd_sm120_configs import (\n"
        "    sm120_block_sparse_config,\n"
        "    sm120_block_sparse_tile_order,\n"
        "    sm120_sparse_block_size,\n"
        ")\n",
    ),
    (
        "import of the tile-order helper",
        "from flash_attn.cute.flash_fwd_sm120_tma import FlashAttentionForwardSm120Tma\n",
        "from flash_attn.cute.flash_fwd_sm120_tma import FlashAttentionForwardSm120Tma\n"
        "from flash_attn.cute.flash_fwd_sm120_tma import with_tile_order as sm120_with_tile_order\n",
    ),
    (
        "SM120 block-sparse tiles launch longest first",
        "        q_subtile_factor = block_sparse_config.q_subtile_factor\n"
        "        kv_subtile_factor = block_sparse_config.kv_subtile_factor\n"
        "    if aux_tensors is not None:\n",
        "        q_subtile_factor = block_sparse_config.q_subtile_factor\n"
        "        kv_subtile_factor = block_sparse_config.kv_subtile_factor\n"
        "    # SM120: the TMA family launches block-sparse tiles longest list first (WorkOrderedTileScheduler in\n"
        "    # flash_fwd_sm120_tma.py: the lists give tiles unequal work); varlen q keeps its own scheduler\n"
        "    sm120_tile_order = None\n"
        "    if arch // 10 == 12 and block_sparse_tensors is not None and cu_seqlens_q is None and seqused_q is None:\n"
        "        sm120_packed_rows = qhead_per_kvhead if pack_gqa else 1\n"
        "        sm120_tile_order = sm120_block_sparse_tile_order(\n"
        "            block_sparse_config,\n"
        "            batch=batch_size,\n"
        "            grid_heads=num_head // sm120_packed_rows,\n"
        "            num_block=-(-seqlen_q * sm120_packed_rows // tile_m),\n"
        "            tiles_per_sparse_row=sm120_packed_rows * q_subtile_factor,\n"
        "        )\n"
        "    if aux_tensors is not None:\n",
    ),
    (
        "the tile order joins the compile key",
        "        use_block_sparsity,\n"
        "        block_sparse_broadcast_pattern,\n"
        "        tensor_broadcast_patterns,\n",
        "        use_block_sparsity,\n"
        "        block_sparse_broadcast_pattern,\n"
        "        sm120_tile_order is not None,\n"
        "        tensor_broadcast_patterns,\n",
    ),
    (
        "the tile order rides as the last aux tensor (compile)",
        "                sparse_tensors,\n"
        "                AuxData(cute_aux_tensors, aux_scalars),\n"
        "            ])\n",
        "                sparse_tensors,\n"
        "                sm120_with_tile_order(\n"
        "                    AuxData(cute_aux_tensors, aux_scalars),\n"
        "                    None\n"
        "                    if sm120_tile_order is None\n"
        "                    else to_cute_tensor(sm120_tile_order, assumed_align=4, leading_dim=0),\n"
        "                ),\n"
        "            ])\n",
    ),
    (
        "the tile order rides as the last aux tensor (launch)",
        "                else None,\n"
        "                AuxData(aux_tensors, aux_scalars),\n"
        "            ])\n",
        "                else None,\n"
        "                sm120_with_tile_order(AuxData(aux_tensors, aux_scalars), sm120_tile_order),\n"
        "            ])\n",
    ),
    (
        "import of the SM120 block-sparse backward",
        "from flash_attn.cute.flash_bwd_sm120_configs import sm120_bwd_config, sm120_bwd_deterministic_plan\n",
        "from flash_attn.cute.flash_bwd_sm120_configs import sm120_bwd_config, sm120_bwd_deterministic_plan\n"
        "from flash_attn.cute.flash_bwd_sm120_configs import (\n"
        "    sm120_bwd_block_sparse_config,\n"
        "    sm120_bwd_block_sparse_dq_turns,\n"
        "    sm120_bwd_block_sparse_preferred,\n"
        "    sm120_check_block_sparse_bwd,\n"
        ")\n"
        "from flash_attn.cute.flash_bwd_sm120_block_sparse import FlashAttentionBackwardSm120BlockSparse\n",
    ),
    (
        "_get_fwd_config takes the block-sparse config",
        "    sm120_tma_ok: bool = False,\n"
        ") -> FwdConfig:\n",
        "    sm120_tma_ok: bool = False,\n"
        "    sm120_block_sparse_cfg=None,\n"
        ") -> FwdConfig:\n",
    ),
    (
        "SM120 tiles of a block-sparse call",
        "            sm120_cfg = sm120_fwd_config(\n"
        "                head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q, tma_ok=sm120_tma_ok\n"
        "            )\n",
        "            sm120_cfg = sm120_block_sparse_cfg  # block sparsity: the caller's TMA config\n"
        "            if sm120_cfg is None:\n"
        "                sm120_cfg = sm120_fwd_config(\n"
        "                    head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q, tma_ok=sm120_tma_ok\n"
        "                )\n",
    ),
    (
        "SM120 block-sparse calls get a TMA config",
        "            pack_gqa = False\n"
        "\n"
        "    # SM120: the TMA family takes unsplit, unpaged calls without sinks, block sparsity or broadcast\n",
        "            pack_gqa = False\n"
        "\n"
        "    # SM120 block sparsity: the TMA family walks the lists (flash_fwd_sm120_block_sparse.py), unsplit\n"
        "    # (num_splits is a hint), with the first SM120_BLOCK_SPARSE_CONFIGS entry whose tile divides the\n"
        "    # sparse block; GQA heads stay packed only where that tile holds whole head groups\n"
        "    sm120_sparse_cfg = None\n"
        "    if arch // 10 == 12 and block_sparse_tensors is not None:\n"
        "        sm120_sparse_refused = [\n"
        "            what\n"
        "            for what, used in (\n"
        "                (\"seqused_k without cu_seqlens_k\", seqused_k is not None and cu_seqlens_k is None),\n"
        "                (\"paged KV\", page_table is not None),\n"
        "                (\"stride-0 (expanded) q/k/v\", any(any(get_broadcast_dims(t)) for t in (q, k, v) if t is not None)),\n"
        "            )\n"
        "            if used\n"
        "        ]\n"
        "        if sm120_sparse_refused:\n"
        "            raise NotImplementedError(\n"
        "                \"block sparsity on SM120 runs in the TMA family, which does not take \"\n"
        "                + \", \".join(sm120_sparse_refused)\n"
        "            )\n"
        "        sm120_sparse_block = sm120_sparse_block_size(block_sparse_tensors, seqlen_q, seqlen_k)\n"
        "        block_sparse_tensors = block_sparse_tensors._replace(block_size=sm120_sparse_block)\n"
        "        sm120_sparse_varlen_q = cu_seqlens_q is not None or seqused_q is not None\n"
        "        sm120_sparse_cfg = sm120_block_sparse_config(\n"
        "            head_dim, head_dim_v, sm120_sparse_block, fp16=q.dtype == torch.float16, tile_mn=tile_mn,\n"
        "            varlen_q=cu_seqlens_q is not None,\n"
        "        )\n"
        "        num_splits = 1\n"
        "        if pack_gqa and (sm120_sparse_cfg.tile_m % qhead_per_kvhead != 0 or sm120_sparse_varlen_q):\n"
        "            # the family's Q/O TMA boxes hold whole head groups, of dense q only\n"
        "            pack_gqa = False\n"
        "\n"
        "    # SM120: the TMA family takes unsplit, unpaged calls without sinks, block sparsity or broadcast\n",
    ),
    (
        "_get_fwd_config call passes the block-sparse config",
        "        sm120_tma_ok=sm120_tma_ok,\n"
        "    )\n"
        "    mla_fwd_cls = None\n",
        "        sm120_tma_ok=sm120_tma_ok,\n"
        "        sm120_block_sparse_cfg=sm120_sparse_cfg,\n"
        "    )\n"
        "    mla_fwd_cls = None\n",
    ),
    (
        "SM120 warps and stages of a block-sparse call",
        "            tma_ok=sm120_tma_ok,\n"
        "        )\n"
        "        num_threads = sm120_fwd_cfg.num_threads\n",
        "            tma_ok=sm120_tma_ok,\n"
        "        )\n"
        "        if sm120_sparse_cfg is not None:\n"
        "            sm120_fwd_cfg = sm120_sparse_cfg  # block sparsity: the TMA config chosen above\n"
        "        num_threads = sm120_fwd_cfg.num_threads\n",
    ),
    (
        "SM120 takes K/V subtiles",
        "            allow_kv_subtile=arch // 10 in [10, 11],\n",
        "            # SM120: the TMA family walks every K/V tile of a sparse block (flash_fwd_sm120_block_sparse.py)\n"
        "            allow_kv_subtile=arch // 10 in [10, 11, 12],\n",
    ),
    (
        "SM120 forward takes block sparsity",
        "            assert not use_block_sparsity, \"Block sparsity not supported on SM 12.0\"\n",
        "",
    ),
    (
        "SM120 TMA class with the subtile factors",
        "            if sm120_fwd_cfg.family == \"tma\":\n"
        "                sm120_fwd_cls = FlashAttentionForwardSm120Tma\n",
        "            if sm120_fwd_cfg.family == \"tma\":\n"
        "                sm120_fwd_cls = FlashAttentionForwardSm120Tma\n"
        "            if use_block_sparsity:\n"
        "                # the TMA family walks the lists: a sparse block spans q_subtile_factor Q tiles and\n"
        "                # kv_subtile_factor K/V tiles (sm120_sparse_cfg is a TMA config); tiles longest first\n"
        "                sm120_split_kwargs = dict(\n"
        "                    q_subtile_factor=q_subtile_factor,\n"
        "                    kv_subtile_factor=kv_subtile_factor,\n"
        "                    ordered_tiles=sm120_tile_order is not None,\n"
        "                )\n",
    ),
    (
        "SM120 backward takes block sparsity",
        "        assert not (block_sparse_tensors is not None), \"Block sparsity backward not supported on SM 12.0\"\n",
        "",
    ),
    (
        "SM120 block-sparse backward config",
        "        sm120_bwd_cfg = sm120_bwd_config(head_dim, head_dim_v, causal, local, modifiers=sm120_mods)\n",
        "        sm120_bwd_cfg = sm120_bwd_config(\n"
        "            head_dim, head_dim_v, causal, local,\n"
        "            modifiers=sm120_mods or block_sparse_tensors is not None,  # the list walk is the modifier step\n"
        "        )\n"
        "        if block_sparse_tensors is not None:\n"
        "            # block sparsity: FlashAttentionBackwardSm120BlockSparse walks the Q-direction lists\n"
        "            # (flash_bwd_sm120_block_sparse.py) with one Q and one dO stage, on the table's tile or\n"
        "            # SM120's earlier default one, whichever divides the sparse block\n"
        "            # (causal and local windows apply inside the listed tiles; deterministic=True takes each list\n"
        "            # entry's dQ turn from the lists, below)\n"
        "            sm120_check_block_sparse_bwd(\n"
        "                deterministic,\n"
        "                varlen=any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)),\n"
        "                turns_from_lists=True,\n"
        "            )\n"
        "            sm120_varlen = any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))\n"
        "            sm120_bwd_cfg = sm120_bwd_block_sparse_config(\n"
        "                sm120_bwd_cfg, head_dim, head_dim_v, block_sparse_tensors.block_size,\n"
        "                preferred=sm120_bwd_block_sparse_preferred(\n"
        "                    head_dim, head_dim_v, causal, local,\n"
        "                    score_mod is not None or bool(softcap) or bool(aux_tensors),\n"
        "                    bool(deterministic), sm120_varlen,\n"
        "                ),\n"
        "            )\n"
        "            kv_subtile_factor = block_sparse_tensors.block_size[1] // sm120_bwd_cfg.n_block\n",
    ),
    (
        "SM120 deterministic lists take their dQ turns from the lists",
        "            kv_subtile_factor=kv_subtile_factor,\n"
        "        )\n"
        "        if deterministic:\n"
        "            if normalized_block_sparse_tensors.dq_write_order is None:\n",
        "            kv_subtile_factor=kv_subtile_factor,\n"
        "        )\n"
        "        if deterministic and arch // 10 == 12:\n"
        "            # SM120: each list entry's dQ turn computed from the lists (ascending K/V blocks; a given\n"
        "            # dq_write_order or spt is not needed), waited for on the walk's own barriers (fused_turns)\n"
        "            sm120_turns = sm120_bwd_block_sparse_dq_turns(\n"
        "                normalized_block_sparse_tensors.mask_block_cnt, normalized_block_sparse_tensors.mask_block_idx,\n"
        "                normalized_block_sparse_tensors.full_block_cnt, normalized_block_sparse_tensors.full_block_idx,\n"
        "                -(-seqlen_q // int(block_sparse_tensors.block_size[0])),\n"
        "            )\n"
        "            normalized_block_sparse_tensors = normalized_block_sparse_tensors._replace(\n"
        "                dq_write_order=sm120_turns[0], dq_write_order_full=sm120_turns[1], spt=False\n"
        "            )\n"
        "            sm120_det_plan = sm120_bwd_deterministic_plan(\n"
        "                0, sm120_bwd_cfg, causal, seqlen_q, seqlen_k, flags={\"fused_turns\": True}\n"
        "            )\n"
        "        elif use_block_sparsity and arch // 10 == 12:\n"
        "            # (the walk reads no turns without deterministic=True: none in the kernel's arguments)\n"
        "            normalized_block_sparse_tensors = normalized_block_sparse_tensors._replace(\n"
        "                dq_write_order=None, dq_write_order_full=None\n"
        "            )\n"
        "            # its K/V tiles launch longest list first (WorkOrderedTileScheduler, flash_fwd_sm120_tma.py):\n"
        "            # a K/V block of global tokens is named by every Q block and, in grid order, ran last; the\n"
        "            # deterministic walk keeps the grid order (a tile waits only for tiles launched before it)\n"
        "            sm120_bwd_tile_order = sm120_block_sparse_tile_order(\n"
        "                NormalizedBlockSparseConfig(\n"
        "                    normalized_block_sparse_tensors, block_sparse_broadcast_pattern, q_subtile_factor,\n"
        "                    kv_subtile_factor,\n"
        "                ),\n"
        "                batch=batch_size,\n"
        "                grid_heads=num_head,\n"
        "                num_block=-(-seqlen_k // n_block_size),\n"
        "                tiles_per_sparse_row=kv_subtile_factor,\n"
        "            )\n"
        "        if deterministic:\n"
        "            if normalized_block_sparse_tensors.dq_write_order is None:\n",
    ),
    (
        "the K/V subtile factor joins the compile key",
        "            use_block_sparsity,\n"
        "            q_subtile_factor,\n"
        "            block_sparse_broadcast_pattern,\n",
        "            use_block_sparsity,\n"
        "            q_subtile_factor,\n"
        "            kv_subtile_factor,\n"
        "            block_sparse_broadcast_pattern,\n"
        "            sm120_bwd_tile_order is not None,\n",
    ),
    (
        "SM120 builds the block-sparse class",
        "            if sm120_mods or deterministic or sm120_bwd_cfg.v_in_regs:\n"
        "                sm120_bwd_cls = FlashAttentionBackwardSm120Mods\n"
        "                sm120_mod_kwargs = dict(mask_mod=mask_mod, has_aux_tensors=aux_tensors is not None)\n",
        "            if sm120_mods or deterministic or sm120_bwd_cfg.v_in_regs:\n"
        "                sm120_bwd_cls = FlashAttentionBackwardSm120Mods\n"
        "                sm120_mod_kwargs = dict(mask_mod=mask_mod, has_aux_tensors=aux_tensors is not None)\n"
        "            if use_block_sparsity:\n"
        "                sm120_bwd_cls = FlashAttentionBackwardSm120BlockSparse\n"
        "                sm120_mod_kwargs = dict(\n"
        "                    mask_mod=mask_mod, has_aux_tensors=aux_tensors is not None,\n"
        "                    q_subtile_factor=q_subtile_factor, kv_subtile_factor=kv_subtile_factor,\n"
        "                    has_full=normalized_block_sparse_tensors.full_block_cnt is not None,\n"
        "                    ordered_tiles=sm120_bwd_tile_order is not None,\n"
        "                )\n",
    ),
    (
        "the backward's tile order starts unset",
        "    sm120_det_plan = {}  # SM120's deterministic ordering: FlashAttentionBackwardSm120Tuned's keywords\n",
        "    sm120_det_plan = {}  # SM120's deterministic ordering: FlashAttentionBackwardSm120Tuned's keywords\n"
        "    sm120_bwd_tile_order = None  # SM120 block sparsity: the K/V tiles' launch order (below)\n",
    ),
    (
        "import of the normalized lists' wrapper",
        "    normalize_block_sparse_config_bwd,\n"
        ")\n",
        "    normalize_block_sparse_config_bwd,\n"
        "    NormalizedBlockSparseConfig,\n"
        ")\n",
    ),
    (
        "the backward's tile order rides as the last aux tensor (compile)",
        "            dV_semaphore_tensor,\n"
        "            AuxData(cute_aux_tensors, aux_scalars),\n"
        "            sparse_tensors_compile,\n"
        "        ]\n",
        "            dV_semaphore_tensor,\n"
        "            sm120_with_tile_order(\n"
        "                AuxData(cute_aux_tensors, aux_scalars),\n"
        "                None\n"
        "                if sm120_bwd_tile_order is None\n"
        "                else to_cute_tensor(sm120_bwd_tile_order, assumed_align=4, leading_dim=0),\n"
        "            ),\n"
        "            sparse_tensors_compile,\n"
        "        ]\n",
    ),
    (
        "the backward's tile order rides as the last aux tensor (launch)",
        "            dV_semaphore,\n"
        "            AuxData(aux_tensors, aux_scalars),\n"
        "            (\n"
        "                normalized_block_sparse_tensors.mask_block_cnt,\n",
        "            dV_semaphore,\n"
        "            sm120_with_tile_order(AuxData(aux_tensors, aux_scalars), sm120_bwd_tile_order),\n"
        "            (\n"
        "                normalized_block_sparse_tensors.mask_block_cnt,\n",
    ),
)
