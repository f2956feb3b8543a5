"""Apply small, plausible bugs to a scratch copy of the repository, one at a time, and show
that the tests named for each one catch it (issue 10).

    python tools/mutation_check.py            # every mutation; exit 1 if any survives
    python tools/mutation_check.py --list     # what each mutation does and which tests catch it
    python tools/mutation_check.py --only temperature_inverted --only finish_keeps_chunked

Each mutation is (file, exact old snippet, replacement, pytest node ids). The script copies
the working tree (tracked and untracked, not ignored files) to a scratch directory, runs all
named tests once unmutated (they must pass), then for each mutation replaces the snippet,
runs its tests with PYTHONPATH pointing at the scratch copy (server subprocesses inherit it)
and restores the file. Outcomes:

    caught      a named test failed (pytest exit 1)
    SURVIVED    every named test passed: the suite misses this bug
    NO SNIPPET  the old snippet is not in the file exactly once: the code moved, update it
    ERROR       pytest could not run the tests (exit >= 2: a test id renamed, a crash)

The exit status is 0 only when every mutation is caught. Too slow for CI (minutes); run it
after refactoring the code a mutation touches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PER_TEST_TIMEOUT_S = 300  # pytest-timeout per test, so a mutation that hangs a test still ends


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what the mutated code gets wrong
    file: str  # relative to the repository root
    old: str  # exact snippet; must occur once
    new: str
    tests: tuple[str, ...]  # pytest node ids expected to catch it


SCHED = "python/pdserve/engine/scheduler.py"
KV_MANAGER = "python/pdserve/mem/cache_manager.py"
T_PD = "test/disagg/test_pd_flow.py"
T_TRUST = "test/disagg/test_pd_trust.py"
SAMPLER = "python/pdserve/engine/sampler.py"
STAGE = "python/pdserve/layers/attention/torch_native.py"
T_SCHED = "test/engine/test_scheduler.py"
T_PATHS = "test/engine/test_scheduler_paths.py"
T_STAGE = "test/engine/test_staged_decode_kv.py"
T_SAMPLER = "test/engine/test_sampler.py"
NIXL = "python/pdserve/transfer/nixl.py"
GRAMMAR = "python/pdserve/engine/grammar.py"
T_GRAMMAR = "test/engine/test_grammar.py"
T_TRANSFER = "test/transfer/test_transfer.py"

MUTATIONS = (
    Mutation(
        "stop_string_newest_token", "stop strings are checked against the newest token's text only",
        "python/pdserve/engine/stop.py",
        "window = self.tail + pending",
        "window = pending",
        (f"{T_SCHED}::test_stop_string_spanning_two_tokens",)),
    Mutation(
        "finish_keeps_chunked", "_finish leaves an aborted chunked prefill in self.chunked",
        SCHED,
        "            if self.chunked is req:\n                self.chunked = None\n",
        "",
        (f"{T_PATHS}::test_abort_during_chunked_prefill",)),
    Mutation(
        "stage_ignores_identity", "the staged decode KV compares lengths only, not request identity",
        STAGE,
        "        if fb.req_uids == old_uids and torch.equal(old_lens + 1, fb.seq_lens):\n",
        "        if torch.equal(old_lens + 1, fb.seq_lens):\n",
        (f"{T_STAGE}::test_batch_swap_with_aligned_lengths",
         "test/layers/test_attention.py::test_staged_decode_rebuilds_when_the_batch_changes_but_lengths_line_up")),
    Mutation(
        "batch_wide_top_p", "one batch-wide min(top_p) filters every row",
        SAMPLER,
        "top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)",
        "top_p = torch.tensor([min(p.top_p for p in params)] * len(params), dtype=probs.dtype)",
        (f"{T_SAMPLER}::test_temperature_and_filters_apply_per_row",)),
    Mutation(
        "temperature_inverted", "logits are multiplied by the temperature instead of divided",
        SAMPLER,
        "probs = torch.softmax(logits / temps[:, None], dim=-1)",
        "probs = torch.softmax(logits * temps[:, None], dim=-1)",
        (f"{T_SAMPLER}::test_temperature_half_follows_softmax_of_twice_the_logits",)),
    Mutation(
        "disconnect_not_aborted", "a request whose HTTP client went away is never aborted",
        "python/pdserve/entrypoints/tokenizer_manager.py",
        "            if not finished and state.error is None:\n                self._try_send(AbortReq(key))\n",
        "            if not finished and state.error is None:\n                pass\n",
        ("test/entrypoints/test_http_server.py::test_client_disconnect_aborts_the_request",)),
    Mutation(
        "cached_prefix_slots_not_written", "admission does not write the cached prefix's slots into the table row",
        KV_MANAGER,
        "        if match.pages:\n"
        "            self.table.write(row, 0, self.table.slots_for(req.pages, 0, req.kv_len))\n",
        "",
        (f"{T_PATHS}::test_prefix_hit_in_a_row_another_request_used_with_chunked_prefill",)),
    # Beyond the audit's seven: paths the new tests cover.
    Mutation(
        "stage_capacity_unchecked", "the staged decode KV appends past its capacity instead of rebuilding",
        STAGE,
        "        if L > self.capacity or B > self.row_capacity or old_uids is None",
        "        if B > self.row_capacity or old_uids is None",
        (f"{T_STAGE}::test_decoding_past_the_staged_kv_margin",)),
    Mutation(
        "cached_tokens_from_readmission", "cached_tokens reports the re-admission's hit after a retraction",
        SCHED,
        "        if req.num_retractions == 0 and not req.output_ids:  # not back from a retraction or a jump-forward\n"
        "            req.cached_tokens_reported = req.cached_len\n",
        "        if True:\n            req.cached_tokens_reported = req.cached_len\n",
        (f"{T_PATHS}::test_retraction_keeps_seeded_sampling_logprobs_stop_strings_and_cached_tokens",)),
    Mutation(
        "evict_locked_parent", "eviction climbs into a parent that running requests still lock",
        "python/pdserve/mem/radix_cache.py",
        "if not parent.is_root and not parent.children and parent.lock_ref == 0:",
        "if not parent.is_root and not parent.children:",
        (f"{T_PATHS}::test_shared_prefix_locked_by_running_requests_survives_eviction",)),
    Mutation(
        "evict_locked_leaf", "eviction takes least-recently-used leaves whether or not they are locked",
        "python/pdserve/mem/radix_cache.py",
        "heap = [(n.last_access, n) for n in self._leaves if n.lock_ref == 0]",
        "heap = [(n.last_access, n) for n in self._leaves]",
        (f"{T_PATHS}::test_shared_prefix_locked_by_running_requests_survives_eviction",)),
    Mutation(
        "logprob_of_argmax", "the logprob returned is the argmax token's, not the sampled token's",
        SAMPLER,
        "chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()",
        "chosen = logp.max(-1).values.tolist()",
        (f"{T_SCHED}::test_return_logprob",)),
    Mutation(
        "openai_finish_reason_wrong", "/v1/completions reports finish_reason stop whatever ended the request",
        "python/pdserve/entrypoints/openai_api.py",
        'return None if reason is None else reason.get("type")',
        'return None if reason is None else "stop"',
        ("test/entrypoints/test_http_server.py::test_completions_greedy_matches_engine",)),
    Mutation(
        "batch_shares_first_sampling", "a /generate batch runs every prompt with the first prompt's sampling_params",
        "python/pdserve/entrypoints/native_api.py",
        "    return list(value)\n",
        "    return [value[0]] * n\n",
        ("test/entrypoints/test_http_server.py::test_generate_stream_logprobs_and_batch",)),
    Mutation(
        "parent_never_gone", "the scheduler loop never notices that its parent process died",
        "python/pdserve/engine/scheduler_loop.py",
        "return self.parent_pid is not None and os.getppid() != self.parent_pid",
        "return False",
        ("test/entrypoints/test_scheduler_process.py::test_parent_exit_ends_the_loop",)),
    Mutation(
        "health_ignores_scheduler", "/health answers 200 after the scheduler died",
        "python/pdserve/entrypoints/http_server.py",
        "if not (ctx.tm.healthy and ctx.tm.running_scheduler.is_alive()):",
        "if False:",
        ("test/entrypoints/test_server_lifecycle.py::test_scheduler_crash_fails_health_and_exits_nonzero",)),
    Mutation(
        "quarantine_released_at_once", "decode reuses abandoned pages before prefill's late writes settled",
        "python/pdserve/disagg/decode.py",
        "        pending = inc.sources - set(settled)",
        "        pending = set()",
        (f"{T_PD}::test_an_abort_during_a_slow_transfer_keeps_its_pages_out_of_reach",)),
    Mutation(
        "write_count_unchecked", "decode lands a room without checking prefill's write count",
        "python/pdserve/disagg/receiver.py",
        "        if c.writes != self.expected[key]:",
        "        if False:",
        (f"{T_PD}::test_a_completion_short_of_writes_is_not_trusted",)),
    Mutation(
        "prefill_sends_last_token", "prefill computes (and sends) the prompt's last token too",
        "python/pdserve/disagg/prefill.py",
        "        req.hold_back_last_token()\n",
        "",
        (f"{T_PD}::test_outputs_match_a_colocated_engine",)),
    # The trust boundary (issue 14): each is the bug a test was written against.
    Mutation(
        "quarantine_released_on_verdict", "a death verdict alone frees pages a paused prefill may still write",
        "python/pdserve/disagg/receiver.py",
        "        gone = all(r in self.gone_at and now - self.gone_at[r] >= GONE_PEER_GRACE_S for r in self.pending)",
        "        gone = True",
        (f"{T_TRUST}::test_a_paused_prefill_never_writes_pages_decode_gave_to_another_request",)),
    Mutation(
        "kv_request_unchecked", "prefill writes wherever a KV request says, not where decode published",
        "python/pdserve/disagg/prefill.py",
        "            rec.check_request(kv)\n",
        "",
        (f"{T_TRUST}::test_a_kv_request_outside_the_published_record_is_refused_before_any_write",)),
    Mutation(
        "nonce_unchecked", "decode lands a room on a completion of another life of the room",
        "python/pdserve/disagg/decode.py",
        "if w is not None and w.incoming.nonce == nonce:",
        "if w is not None:",
        (f"{T_TRUST}::test_a_completion_with_another_nonce_does_not_land_the_room",)),
    Mutation(
        "mac_unchecked", "a control frame is accepted whatever its MAC",
        "python/pdserve/disagg/auth.py",
        "if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):",
        "if False:",
        (f"{T_TRUST}::test_with_a_token_unauthenticated_and_wrongly_keyed_frames_are_refused",)),
    Mutation(
        "unknown_abort_unacknowledged", "prefill ignores an abort of a room it holds nothing of (pages wait a lease)",
        "python/pdserve/disagg/prefill.py",
        "        self.io.send(reply, KVAbortAck(msg.room, msg.nonce, self.sender.rank))\n",
        "",
        (f"{T_TRUST}::test_decode_abort_of_a_room_prefill_never_saw_is_acknowledged",)),
    Mutation(
        "stored_page_crc_unchecked", "a stored page is served whatever its payload checksum says",
        "python/pdserve/mem/storage/page_format.py",
        "    if crc32c(payload) != crc:",
        "    if False:",
        ("test/mem/storage/test_file_store.py::test_damaged_files_are_counted_misses_never_wrong_bytes",)),
    Mutation(
        "kv_event_gap_accepted", "the router's KV index applies a batch after a lost one instead of resyncing",
        "python/pdserve/router/kv_index.py",
        "        return self.seq is not None and seq == self.seq + 1",
        "        return True",
        ("test/obs/test_kv_events.py::test_index_refuses_a_gap_and_skips_what_a_snapshot_covers",)),
    Mutation(
        "ranks_take_the_longest_hit", "TP ranks load the longest tier hit any rank has, not the one all have",
        KV_MANAGER,
        "        return min(d + h for d, h, _ in rows)",
        "        return max(d + h for d, h, _ in rows)",
        ("test/mem/test_hicache.py::test_prepare_loads_what_every_rank_holds_waits_while_one_is_busy_and_refuses_"
         "diverged_devices",)),
    # issue 25, finding 4: the storage tier trusts a path
    Mutation(
        "storage_namespace_from_path", "the storage namespace hashes the model path again, not the weights' content",
        SCHED,
        '        return {"weights": content_fingerprint(self.model_config, self.config.random_seed),',
        '        return {"model": str(self.model_config.path),',
        ("test/mem/test_hicache.py::test_weights_swapped_at_the_same_path_are_not_served_the_old_kv",)),
    Mutation(
        "stored_page_mac_unchecked", "under a token a stored page is served without checking its MAC",
        "python/pdserve/mem/storage/page_format.py",
        "    if mac_key is not None:\n        _check_mac(blob, mac_key, payload)",
        "    if False:\n        _check_mac(blob, mac_key, payload)",
        ("test/mem/storage/test_page_format.py::test_a_page_under_a_token_needs_its_mac",
         "test/mem/storage/test_file_store.py::test_under_a_token_a_planted_page_is_a_counted_miss",
         "test/mem/test_hicache.py::test_under_a_token_pages_planted_in_the_file_tier_are_counted_misses")),
    Mutation(
        "storage_file_default_mode", "the file tier creates page files with the default mode, left to the umask",
        "python/pdserve/mem/storage/file.py",
        "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)",
        "fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)",
        ("test/mem/storage/test_file_store.py::test_folders_and_files_are_private_whatever_the_umask",)),
    Mutation(
        "storage_dir_others_may_write", "a storage dir that other users may write is used as is",
        "python/pdserve/mem/storage/file.py",
        "    if st.st_mode & 0o022:",
        "    if False:",
        ("test/mem/storage/test_file_store.py::test_a_storage_dir_others_may_write_is_refused",)),
    # Issue 25, unbounded requests: the request caps and fair admission between API calls.
    Mutation(
        "max_logprobs_unchecked", "a request may ask for top logprobs up to the vocabulary at every position",
        "python/pdserve/entrypoints/logprobs.py",
        "    if 0 <= max_logprobs < k:",
        "    if 0 <= max_logprobs < k and False:",
        ("test/entrypoints/test_logprobs_api.py::test_top_logprobs_over_max_logprobs_is_400_naming_the_flag",)),
    Mutation(
        "max_seqs_per_request_unchecked", "one request may run any number of prompts x n sequences",
        "python/pdserve/entrypoints/parallel_sampling.py",
        "    if total <= cap:",
        "    if True:",
        ("test/entrypoints/test_http_server.py::test_sequences_over_max_seqs_per_request_is_400_naming_the_flag",)),
    Mutation(
        "admission_fcfs_across_groups", "a big request's sequences are all admitted before a later request's",
        "python/pdserve/engine/policy.py",
        "    turns = group_turns(waiting, admitted or {})",
        "    turns = {r: 0 for r in waiting}",
        ("test/engine/test_policy.py::test_a_later_call_takes_turns_with_a_big_one_instead_of_waiting_behind_it",
         "test/engine/test_policy.py::test_a_group_with_sequences_admitted_already_yields_its_turn",
         f"{T_SCHED}::test_a_small_call_is_admitted_between_the_sequences_of_a_big_one")),
    # issue 25, finding 6: admin routes apart (web/api_key.py)
    Mutation(
        "admin_route_takes_the_inference_key", "with --admin-api-key set, the inference key still opens admin routes",
        "python/pdserve/web/api_key.py",
        "        administer = is_admin if self.admin is not None else inference_ok",
        "        administer = is_admin or inference_ok",
        ("test/web/test_api_key.py::test_which_key_opens_which_route",
         "test/entrypoints/test_http_server.py::test_admin_routes_refuse_the_inference_key")),
    Mutation(
        "abort_of_a_foreign_rid_allowed", "a client aborts by rid a request another client started",
        "python/pdserve/entrypoints/tokenizer_manager.py",
        "            keys = [k for k in (scoped_rid(rid, owner),) if k in self._reqs]",
        "            keys = [k for k, state in self._reqs.items() if state.rid == rid]",
        ("test/entrypoints/test_http_server.py::test_a_client_cannot_abort_another_clients_request",)),
    Mutation(
        "router_aborts_for_a_client_with_the_admin_key", "the router sends a client's rid abort with its admin key, "
        "so the workers no longer check whose request it is",
        "python/pdserve/router/app.py",
        '        admin = holds_admin_key(request.scope) or body.get("abort_all")',
        "        admin = True",
        ("test/router/test_router_echo.py::test_admin_routes_need_the_admin_key_and_it_is_what_the_workers_get",)),
    Mutation(
        "unauthenticated_bind_silent", "a server or router open beyond loopback with no key starts without a warning",
        "python/pdserve/web/api_key.py",
        "    if api_key or admin_api_key or is_loopback(host):",
        "    if True:",
        ("test/web/test_api_key.py::test_unauthenticated_beyond_loopback_warns",
         "test/router/test_router_echo.py::test_a_router_beyond_loopback_without_a_key_warns_once")),
    # issue 25, listeners and secrets (nothing beyond --host, secrets off command lines)
    Mutation(
        "kv_events_default_wildcard", "KV events bind every interface by default again (tcp://*:5557)",
        "python/pdserve/config.py",
        "        return f\"tcp://{f'[{host}]' if ':' in host else host}:{KV_EVENTS_DEFAULT_PORT}\"",
        "        return f\"tcp://*:{KV_EVENTS_DEFAULT_PORT}\"",
        ("test/obs/test_kv_event_publisher.py::test_the_default_endpoint_is_the_servers_host_not_every_interface",)),
    Mutation(
        "kv_events_token_ids_to_anyone", "prompt token ids published on a non-loopback, unauthenticated bind",
        "python/pdserve/obs/kv_event_publisher.py",
        "        self.token_ids = local_only(self._bound_at)",
        "        self.token_ids = True",
        ("test/obs/test_kv_event_publisher.py::test_token_ids_are_published_only_to_this_machine",)),
    Mutation(
        "up_secret_on_command_line", "pdserve up puts the API key back on its children's command lines",
        "python/pdserve/entrypoints/up.py",
        "               \"--disaggregation-mode\", role, *",
        "               \"--disaggregation-mode\", role, *([\"--api-key\", args.api_key] if args.api_key else []), *",
        ("test/entrypoints/test_up.py::test_plan_gives_the_secrets_to_every_child_by_environment_not_command_line",)),
    Mutation(
        "up_log_shows_the_token", "the command lines up logs show the P/D token",
        "python/pdserve/entrypoints/up.py",
        "SECRET_FLAGS = (\"--api-key\", \"--worker-api-key\", \"--disaggregation-auth-token\")",
        "SECRET_FLAGS = (\"--api-key\", \"--worker-api-key\")",
        ("test/entrypoints/test_up.py::test_logged_command_lines_hide_every_secret",)),
    Mutation(
        "master_metadata_server_on_every_interface", "mooncake_master's HTTP metadata server (0.0.0.0, any PUT) is on",
        "python/pdserve/mem/storage/mooncake_store.py",
        "            \"-enable_http_metadata_server=false\",",
        "            \"-enable_http_metadata_server=true\", f\"-http_metadata_server_host={self.host}\",",
        ("test/mem/storage/test_mooncake_master.py::test_every_listener_of_the_master_is_on_its_host",)),
    # issue 25, no pickle on any socket (engine/codec.py, engine/node_sockets.py)
    Mutation(
        "codec_accepts_unregistered_type", "the codec decodes a frame whose type name it does not carry",
        "python/pdserve/engine/codec.py",
        "        decoder = self._decoders.get(name)\n",
        "        decoder = self._decoders.get(name, msgspec.msgpack.Decoder())\n",
        ("test/engine/test_codec.py::test_anything_else_is_a_codec_error_that_says_why",)),
    Mutation(
        "codec_frame_unbounded", "a frame over the size bound is decoded anyway",
        "python/pdserve/engine/codec.py",
        "        if len(frame) > self.max_bytes:",
        "        if False:",
        ("test/engine/test_codec.py::test_a_frame_over_the_bound_is_refused_before_decoding",)),
    Mutation(
        "junk_frame_stops_the_loop", "a frame that is none of our messages raises out of the receiving loop",
        "python/pdserve/engine/scheduler_loop.py",
        "        drops.record(e)\n        return None\n",
        "        raise\n",
        ("test/engine/test_codec.py::test_a_scheduler_loop_drops_junk_and_goes_on",)),
    Mutation(
        "multinode_binds_every_interface", "a multi-node frontend binds its scheduler sockets on tcp://*",
        "python/pdserve/engine/node_sockets.py",
        "        return tcp_endpoint(self.bind_host, int(endpoint.rpartition(\":\")[2]))",
        "        return \"tcp://*:\" + endpoint.rpartition(\":\")[2]",
        ("test/engine/test_node_sockets.py::test_tcp_binds_move_to_the_node_address_and_ipc_stays",
         "test/engine/test_node_sockets.py::test_without_a_token_the_sockets_bind_the_node_address_in_clear")),
    Mutation(
        "multinode_frames_unbounded", "a multi-node frontend socket buffers a frame of any size from any peer",
        "python/pdserve/engine/node_sockets.py",
        "        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)\n",
        "",
        ("test/engine/test_node_sockets.py::test_a_frame_over_the_bound_never_reaches_the_frontend",)),
    Mutation(
        "zap_admits_any_client_key", "under the token the frontend admits any CURVE client key",
        "python/pdserve/engine/node_sockets.py",
        "        return hmac.compare_digest(key, self.allowed)",
        "        return True",
        ("test/engine/test_node_sockets.py::test_under_the_token_only_a_rank_holding_it_gets_requests",
         "test/engine/test_node_sockets.py::test_under_the_token_a_stranger_cannot_push_outputs")),
    Mutation(
        "multinode_in_clear_under_token", "several nodes under the cluster token still talk without CURVE",
        "python/pdserve/engine/node_sockets.py",
        "    return CurveKeys.from_token(token) if token else None",
        "    return None",
        ("test/engine/test_node_sockets.py::test_several_nodes_under_the_token_use_curve_and_warn_without_it",)),
    # issue 25, MACs bound to who, where and when (registry target, nonces, signed answers, control frames)
    Mutation(
        "target_binding_skipped", "a registry accepts a request signed for another registry",
        "python/pdserve/disagg/bootstrap.py",
        "if not self.server.answers_to(signed.target, self.connection.getsockname()[0]):",
        "if False:",
        ("test/disagg/test_bootstrap.py::test_a_request_signed_for_one_registry_is_refused_by_another",
         f"{T_TRUST}::test_an_api_client_cannot_write_its_kv_into_another_users_cached_prefix")),
    Mutation(
        "replay_cache_not_consulted", "a registry accepts a captured signed request again",
        "python/pdserve/disagg/bootstrap.py",
        "if not self.server.nonces.add(signed.nonce, signed.t):",
        "if False:",
        ("test/disagg/test_bootstrap.py::test_a_captured_signed_request_replayed_is_refused",)),
    Mutation(
        "answer_signature_not_verified", "decode takes records from a registry that cannot prove the token",
        "python/pdserve/disagg/bootstrap.py",
        "            self.auth.verify_answer(nonce, status, data, header)\n",
        "            pass\n",
        ("test/disagg/test_bootstrap.py::test_answers_are_signed_and_a_client_under_a_token_refuses_a_registry_that_"
         "cannot_sign",
         f"{T_TRUST}::test_an_api_client_cannot_write_its_kv_into_another_users_cached_prefix")),
    Mutation(
        "control_destination_unchecked", "a control frame sent to another endpoint is accepted",
        "python/pdserve/disagg/channel.py",
        "if b.destination != self.endpoint:",
        "if False:",
        ("test/disagg/test_channel.py::test_a_frame_for_another_endpoint_is_refused_and_counted",
         "test/disagg/test_channel.py::test_channels_bind_their_frames_and_a_captured_frame_replays_nowhere")),
    Mutation(
        "control_sequence_unchecked", "a control frame read before is accepted again (a replay)",
        "python/pdserve/disagg/channel.py",
        "elif not self._seen.add(b):",
        "elif False:",
        ("test/disagg/test_channel.py::test_a_replayed_or_stale_frame_is_refused_and_counted",
         f"{T_TRUST}::test_a_control_frame_replayed_after_the_lease_is_refused_and_nothing_is_written")),
    Mutation(
        "peer_budget_skipped", "every frame is MAC'd whatever its peer already sent",
        "python/pdserve/disagg/channel.py",
        "if size > MAX_FRAME_BYTES or not self._spend(peer, size):",
        "if size > MAX_FRAME_BYTES:",
        ("test/disagg/test_channel.py::test_over_budget_and_oversized_frames_are_refused_before_any_mac_work",)),
    # the router's view of roles after a switch (test_role_switch's flake)
    Mutation(
        "roles_not_rechecked_after_a_switch", "a decode that answers it became prefill leaves the router's sets as "
        "they were until the next health check: the request gets a 502 while the new decode is unseen",
        "python/pdserve/router/proxy.py",
        "            if switched and self.refresh_roles is not None:",
        "            if False:",
        ("test/router/test_router_echo.py::"
         "test_a_decode_that_became_prefill_sends_the_request_to_the_server_that_became_decode",)),
    Mutation(
        "top_k_past_int64_accepted", "a top_k past int64 passes validation and overflows the sampler's tensor",
        "python/pdserve/engine/request.py",
        "(self.top_k < 1 and self.top_k != -1) or self.top_k > INT64_MAX:",
        "(self.top_k < 1 and self.top_k != -1):",
        ("test/entrypoints/test_http_fuzz.py::test_a_top_k_past_the_vocabulary_samples_from_all_of_it",)),
    # issue 24, mem/: KVCacheManager is the only code that frees device pages
    Mutation(
        "manager_drops_evicted_pages", "the manager counts the pages eviction returns but never frees them",
        KV_MANAGER,
        "        self.num_evicted_pages += len(pages)\n        self.allocator.free(pages)\n",
        "        self.num_evicted_pages += len(pages)\n",
        ("test/mem/test_cache_manager.py::test_evicted_pages_come_back_through_the_manager",
         "test/mem/test_cache_manager.py::test_eviction_goes_through_the_owner")),
    Mutation(
        "radix_frees_its_duplicates", "the radix cache frees duplicate pages itself behind the manager's back "
        "(the same pages end free; only the owner changed)",
        "python/pdserve/mem/radix_cache.py",
        "        return InsertResult(len(pages) - len(path), duplicates)",
        "        self.allocator.free(duplicates)\n        return InsertResult(len(pages) - len(path), [])",
        ("test/mem/test_cache_manager.py::test_only_the_manager_frees_device_pages_in_mem",
         "test/mem/test_cache_manager.py::test_every_device_page_is_freed_by_the_manager[_radix_workload]")),
    Mutation(
        "hiradix_frees_redundant_load", "a load-back whose blocks were recomputed meanwhile frees its copies "
        "from the hierarchical cache instead of handing them to the manager",
        "python/pdserve/mem/hiradix_cache.py",
        "                h.redundant.append(dp)",
        "                self.allocator.free([dp])",
        ("test/mem/test_cache_manager.py::test_only_the_manager_frees_device_pages_in_mem",
         "test/mem/test_cache_manager.py::test_every_device_page_is_freed_by_the_manager[_hicache_workload]")),
    Mutation(
        "redundant_load_pages_unaccounted", "a finished load's redundant copies, held until the manager frees "
        "them, are counted nowhere: check() calls them a leak",
        KV_MANAGER,
        "        loading += sum(len(h.redundant) for h in self._loads.values())\n",
        "",
        ("test/mem/test_cache_manager.py::test_every_device_page_is_freed_by_the_manager[_hicache_workload]",)),
    # issue 24: decode's own prefix cache across P/D (partial hits, pages asked for, bytes moved)
    Mutation(
        "decode_ignores_own_cache", "decode matches nothing of its own cache when it asks prefill for KV, so a "
        "turn 2 whose turn 1 decode still holds moves every page again",
        "python/pdserve/disagg/decode.py",
        "        if not kv.admit(req, req.fill_ids[:-1]):",
        "        if not kv.admit(req, req.fill_ids[:0]):",
        ("test/disagg/test_pd_decode_cache.py::test_turn_two_asks_prefill_only_for_the_pages_decode_lacks[mooncake]",)),
    Mutation(
        "decode_asks_for_every_page", "decode asks prefill for every page of prompt[:-1], its cached ones included",
        "python/pdserve/disagg/decode.py",
        "self._send_kv_request(req, peer, req.pages[req.num_cached_pages:], aux_slot, now)",
        "self._send_kv_request(req, peer, req.pages, aux_slot, now)",
        ("test/disagg/test_pd_decode_cache.py::test_turn_two_asks_prefill_only_for_the_pages_decode_lacks[mooncake]",)),
    Mutation(
        "decode_local_hit_unreported", "a request decode prefills itself reports no decode_cached_tokens",
        "python/pdserve/disagg/decode.py",
        "            if r.decode_cached_tokens is None:\n",
        "            if False:\n",
        ("test/disagg/test_pd_decode_cache.py::test_turn_two_asks_prefill_only_for_the_pages_decode_lacks[mooncake]",)),
    # issue 24, front slice: config built once, secrets read once, per-server token-text memo
    Mutation(
        "disagg_config_rebuilt", "ServerArgs.disagg_config builds a new DisaggConfig (reading the token file) per call",
        "python/pdserve/config.py",
        "    @_built_once\n    def disagg_config(self) -> DisaggConfig:",
        "    def disagg_config(self) -> DisaggConfig:",
        ("test/test_config.py::test_sub_configs_are_built_once_and_handed_out_as_they_are",
         "test/test_config.py::test_the_token_file_is_read_once_however_often_its_configs_are_asked_for")),
    Mutation(
        "hicache_token_reread", "the HiCache config reads the token file itself instead of taking the one read",
        "python/pdserve/config.py",
        "return HiCacheConfig(**flags, auth_token=self.auth_token(), host=self.host)",
        "return HiCacheConfig(**flags, auth_token=resolve_token(self.disaggregation_auth_token,\n"
        "                                                               self.disaggregation_auth_token_file),\n"
        "                             host=self.host)",
        ("test/test_config.py::test_the_token_file_is_read_once_however_often_its_configs_are_asked_for",)),
    Mutation(
        "token_texts_per_request", "each OpenAI call decodes its logprob token texts into a fresh memo",
        "python/pdserve/entrypoints/openai_api.py",
        "include_usage, jobs[0].rid, tm.token_texts)",
        "include_usage, jobs[0].rid, TokenTexts(tm.tokenizer))",
        ("test/entrypoints/test_tokenizer_manager.py::test_token_texts_are_one_memo_per_server",)),
    Mutation(
        "engine_token_texts_per_request", "each Engine.generate decodes its logprob token texts into a fresh memo",
        "python/pdserve/entrypoints/engine.py",
        "texts = self.token_texts if return_text_in_logprobs else None",
        "texts = TokenTexts(self.tokenizer) if return_text_in_logprobs else None",
        ("test/entrypoints/test_engine.py::test_engine_logprob_texts_are_decoded_once_per_engine",)),
    # NIXL backend (issue 24, slice nixl)
    Mutation(
        "nixl_done_before_landed", "a NIXL batch reports DONE once posted, before NIXL or the receiver "
        "says anything (dropping only the receiver's answer survives on TCP here: UCX's DONE already waits "
        "for the receiver, see nixl.py)",
        NIXL, "if b.xfer is None and (b.error is not None or (b.sent and b.acked)):",
        "if b.error is not None or True:",
        (f"{T_TRANSFER}::test_a_write_to_a_stopped_peer_is_not_done_until_it_runs[nixl]",)),
    Mutation(
        "nixl_notify_before_data", "write_sync's notify leaves as its own notification before the data",
        NIXL, "        handle = self._post(peer, *base.merge_contiguous(srcs, dsts, lens), payload=payload)",
        "        if notify is not None:\n"
        "            with self._lock:\n"
        "                self._agent.send_notif(peer, _WRITE + bytes(_SEQ_BYTES) + payload)\n"
        "        handle = self._post(peer, *base.merge_contiguous(srcs, dsts, lens), payload=b\"\")",
        (f"{T_TRANSFER}::test_notify_never_overtakes_its_data[nixl]",)),
    Mutation(
        "nixl_stall_never_fails", "a NIXL write to a peer that never answers stays PENDING forever",
        NIXL, "if b.error is None and not b.acked and now > b.deadline:", "if False:",
        (f"{T_TRANSFER}::test_first_contact_with_a_hung_peer_blocks_nobody[nixl]",)),
    Mutation(
        "nixl_record_names_unchecked", "a record's NIXL metadata of another agent is loaded under its session",
        NIXL, "            if name != peer:\n", "            if False:\n",
        (f"{T_TRANSFER}::test_nixl_refuses_a_record_whose_metadata_names_another_agent",)),
    Mutation(
        "nixl_ib_modules_loaded", "UCX loads its InfiniBand modules on TCP too: processes die with SIGSEGV at exit",
        NIXL, '    env = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib"}', '    env = {"UCX_TLS": "tcp"}',
        (f"{T_TRANSFER}::test_a_process_with_nixl_agents_exits_cleanly",)),
    Mutation(
        "mixed_backends_accepted", "a prefill on NIXL and a decode on Mooncake pass the handshake",
        "python/pdserve/disagg/bootstrap.py", '    transfer_backend: str = "mooncake"\n',
        '    transfer_backend: str = field(default="mooncake", compare=False)\n',
        (f"{T_PD}::test_a_prefill_and_a_decode_on_different_backends_are_refused_naming_both[nixl]",)),
    Mutation(
        "spec_draft_accepted_unverified", "speculative decoding keeps a draft token the target did not choose",
        "python/pdserve/engine/speculative.py",
        "        if d != target[i]:\n            return drafts[:i] + [target[i]]\n",
        "        if False:\n            return drafts[:i] + [target[i]]\n",
        ("test/engine/test_speculative.py::test_accept_greedy_keeps_the_matching_prefix_then_the_targets_token",
         "test/engine/test_speculative.py::test_oracle_draft_accepts_many_and_output_is_identical")),
    Mutation(
        "spec_mtp_kv_not_transferred", "a disaggregated prefill computes the MTP layer's KV but never sends it",
        "python/pdserve/engine/model_runner.py",
        "        hidden = self.draft(fb, target_hidden.to(self.device))  # [T, hidden]\n",
        "        fb.layer_hook = None\n        hidden = self.draft(fb, target_hidden.to(self.device))  # [T, hidden]\n",
        ("test/disagg/test_pd_speculative.py::test_1p1d_greedy_equals_colocated_plain_decoding[NEXTN]",
         "test/disagg/test_pd_speculative.py::test_the_mtp_layers_prompt_kv_lands_on_decode",
         "test/disagg/test_pd_deepseek_v4.py::test_nextn_1p1d_matches_transformers_and_moves_the_draft_layer",
         "test/disagg/test_pd_deepseek_v4.py::test_nextn_through_the_routers_as_real_servers")),
    Mutation(
        "fp8_scale_transposed", "an FP8 checkpoint's [So, Si] block scales are read in column-major order",
        "python/pdserve/layers/quant/fp8.py",
        "    return (w_fp8.float() * _expand(scale_inv.float(), block, tuple(w_fp8.shape))).to(dtype)",
        "    return (w_fp8.float() * _expand(scale_inv.float().T.reshape(scale_inv.shape), block,\n"
        "                                    tuple(w_fp8.shape))).to(dtype)",
        ("test/layers/quant/test_fp8.py::test_scale_is_applied_per_block_row_and_column_not_transposed",
         "test/models/test_fp8_checkpoints.py::test_loaded_weights_equal_the_dequantized_checkpoint",
         "test/models/test_fp8_checkpoints.py::test_greedy_output_matches_transformers_on_the_dequantized_copy")),
    Mutation(
        "fp8_pd_pairs_with_full_precision", "the weight quantization is left out of the P/D compatibility check",
        "python/pdserve/disagg/bootstrap.py", '    quantization: str = "none"\n',
        '    quantization: str = field(default="none", compare=False)\n',
        ("test/disagg/test_bootstrap.py::test_fp8_weights_never_pair_with_full_precision_naming_the_quantization",
         "test/disagg/test_pd_fp8.py::test_fp8_prefill_and_full_precision_decode_are_refused_naming_the_quantization")),
    # issue 23, kernels/: a block scale applied transposed inside the FP8 kernels
    Mutation(
        "fp8_gemm_scale_transposed", "the FP8 GEMM reads weight scale [k-block, n-block] for [n-block, k-block]",
        "kernels/pdserve_kernels/fp8_gemm.py", "w_s = tl.load(WS + w_srow * sws + g,",
        "w_s = tl.load(WS + g * sws + w_srow,",
        ("test/kernels/test_fp8_kernels.py::test_gemm_matches_twin[interp-fp32-N200-K256-5]",)),
    Mutation(
        "fp8_moe_scale_transposed", "the FP8 MoE reads expert scale [k-block, n-block] for [n-block, k-block]",
        "kernels/pdserve_kernels/fp8_moe.py", "w_s = tl.load(WS + e * sws_e + w_srow * sws_n + g,",
        "w_s = tl.load(WS + e * sws_e + g * sws_n + w_srow,",
        ("test/kernels/test_fp8_kernels.py::test_fused_moe_matches_twin[interp-fp32-6]",)),
    # --- FP8 KV cache (issue 23, part 2)
    Mutation(
        "fp8_kv_scale_ignored_on_read", "an fp8 pool's reads drop the per-tensor scale its writes divided by",
        "python/pdserve/mem/kv_pool.py",
        "    return (x.float() * scale).to(dtype)\n",
        "    return x.to(dtype)\n",
        ("test/mem/test_kv_pool.py::test_fp8_gqa_pool_round_trip_saturates_and_applies_its_scales",
         "test/layers/test_fp8_kv_attention.py::test_gqa_over_an_fp8_pool_matches_the_reference_on_the_stored_kv"
         "[16-torch_native]")),
    Mutation(
        "fp8_kv_scale_ignored_in_triton", "the Triton decode kernel reads fp8 keys without their scale",
        "kernels/pdserve_kernels/decode_attention.py",
        "scale * k_scale, v_scale, page_size, G, hblocks, split_len,",
        "scale, v_scale, page_size, G, hblocks, split_len,",
        ("test/layers/test_fp8_kv_attention.py::test_gqa_over_an_fp8_pool_matches_the_reference_on_the_stored_kv"
         "[16-triton]",
         "test/kernels/test_attention_kernels.py::test_gqa_kernels_read_fp8_pools_with_their_scales[interp-fp32-16]")),
    Mutation(
        "fp8_kv_stage_unquantized", "the decode stage appends this step's rows unquantized, unlike the pool",
        STAGE,
        "staged = pool.round_trip_kv(k, v) if md.stage is not None else (k, v)",
        "staged = (k, v)",
        ("test/layers/test_fp8_kv_attention.py::test_gqa_over_an_fp8_pool_matches_the_reference_on_the_stored_kv"
         "[1-torch_native]",)),
    Mutation(
        "kv_cache_dtype_not_compared", "an FP8 prefill pairs with a full-precision decode: the handshake "
        "ignores kv_cache_dtype",
        "python/pdserve/disagg/bootstrap.py",
        '    kv_cache_dtype: str = "auto"\n',
        '    kv_cache_dtype: str = field(default="auto", compare=False)\n',
        ("test/disagg/test_bootstrap.py::test_compat_check_names_the_kv_cache_dtype_and_what_auto_stores",
         f"{T_PD}::test_mismatched_peer_is_refused_naming_the_field[memory-kv_cache_dtype-prefill3-decode3]")),
    Mutation(
        "grammar_mask_skips_second_row", "the token bitmask skips the second request with a grammar in a "
        "decode batch (it samples unconstrained)",
        GRAMMAR,
        "        return [i for i, r in enumerate(reqs) if r.grammar is not None and not _thinking(r.grammar)]\n",
        "        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not _thinking(r.grammar)]\n"
        "        return rows[:1] + rows[2:]\n",
        (f"{T_GRAMMAR}::test_a_batch_mixes_grammar_and_plain_requests[inline]",)),
    Mutation(
        "grammar_not_advanced", "a sampled token is appended but the request's grammar is not moved past it",
        SCHED,
        "advanced = self.grammar.advance_all(reqs, res.tokens) if self.grammar.live else None",
        "advanced = None",
        (f"{T_GRAMMAR}::test_each_constraint_holds_for_each_backend[xgrammar-json_schema]",
         f"{T_GRAMMAR}::test_each_constraint_holds_for_each_backend[llguidance-regex]")),
    # issue 22, tool calls: what the client gets must be every argument the model wrote
    Mutation(
        "tool_parser_drops_last_argument", "the tool parser keeps a JSON member only once a comma follows it, so "
        "the last one is dropped: a call's arguments (last in {name, arguments}) come back empty",
        "python/pdserve/parsers/json_scan.py",
        "        out.members.setdefault(key, Member(p, end))\n        if end is None:\n            return out\n"
        "        p = skip_ws(text, end, stop)\n",
        "        if end is None:\n            return out\n"
        "        member, p = Member(p, end), skip_ws(text, end, stop)\n"
        "        if p < stop and text[p] == \",\":\n            out.members.setdefault(key, member)\n",
        ("test/parsers/test_tool_parsers.py::test_whole_output[qwen25-5]",
         "test/parsers/test_tool_parsers.py::test_stream_at_every_split_point[llama3-11]")),
    # issue 37: security-relevant behaviour the suite did not pin down
    Mutation(
        "stored_page_mac_payload_only", "a stored page's MAC covers its payload only, so a signed page copied "
        "under another key or namespace (header CRC fixed) is served as that prefix's KV",
        "python/pdserve/mem/storage/page_format.py",
        "    h = hmac.new(key, prefix, hashlib.sha256)\n",
        "    h = hmac.new(key, b\"\", hashlib.sha256)\n",
        ("test/mem/storage/test_page_format.py::test_a_signed_page_copied_under_another_key_or_namespace_is_a_bad_mac",
         "test/mem/test_hicache.py::test_under_a_token_a_signed_page_copied_under_another_key_or_namespace_is_a_"
         "counted_miss")),
    Mutation(
        "stored_page_mac_skips_namespace", "a stored page's MAC leaves its namespace out",
        "python/pdserve/mem/storage/page_format.py",
        "    h = hmac.new(key, prefix, hashlib.sha256)\n",
        "    h = hmac.new(key, prefix[:8] + prefix[40:], hashlib.sha256)\n",
        ("test/mem/storage/test_page_format.py::test_a_signed_page_copied_under_another_key_or_namespace_is_a_bad_mac",
         "test/mem/test_hicache.py::test_under_a_token_a_signed_page_copied_under_another_key_or_namespace_is_a_"
         "counted_miss")),
    Mutation(
        "stored_page_mac_skips_key", "a stored page's MAC leaves its key out",
        "python/pdserve/mem/storage/page_format.py",
        "    h = hmac.new(key, prefix, hashlib.sha256)\n",
        "    h = hmac.new(key, prefix[:40] + prefix[72:], hashlib.sha256)\n",
        ("test/mem/storage/test_page_format.py::test_a_signed_page_copied_under_another_key_or_namespace_is_a_bad_mac",
         "test/mem/test_hicache.py::test_under_a_token_a_signed_page_copied_under_another_key_or_namespace_is_a_"
         "counted_miss")),
    Mutation(
        "abort_owner_check_asks_may_administer", "a rid abort skips the owner check when the caller may administer "
        "(without an admin key: anyone) instead of when it presented the admin key",
        "python/pdserve/entrypoints/http_server.py",
        "every_owner=holds_admin_key(scope))",
        "every_owner=may_administer(scope))",
        ("test/router/test_router_pdserve.py::test_only_the_client_that_started_a_request_may_abort_it[no_keys]",
         "test/router/test_router_pdserve.py::test_only_the_client_that_started_a_request_may_abort_it[api_key_only]")),
    Mutation(
        "grammar_cache_key_normalised", "the grammar compile cache keys on the constraint with its whitespace "
        "collapsed, so a regex that differs only in spaces gets another's grammar",
        "python/pdserve/constrained/service.py",
        "        key = (kind, text)\n        with self._lock:\n            fut = self._cache.get(key)\n",
        "        key = (kind, \" \".join(text.split()))\n"
        "        with self._lock:\n            fut = self._cache.get(key)\n",
        ("test/constrained/test_compile_service.py::test_the_cache_keys_on_the_exact_constraint_text",)),
    Mutation(
        "router_resumes_a_finished_stream", "the router resumes a stream whose decode died after its final event",
        "python/pdserve/router/proxy.py",
        "            if relay.stream is not None and relay.stream.finished:\n",
        "            if False:\n",
        ("test/router/test_router_echo.py::test_a_decode_that_dies_after_its_final_event_is_not_resumed",)),
    Mutation(
        "kv_events_snapshot_open", "GET /kv_events/snapshot (the blocks a server caches) needs no key",
        "python/pdserve/web/api_key.py",
        "    \"/kv_events/snapshot\": Access.WORKER,",
        "    \"/kv_events/snapshot\": Access.OPEN,",
        ("test/entrypoints/test_http_server.py::test_the_kv_events_snapshot_needs_a_key",)),
    Mutation(
        "approx_text_blocks_unchained", "the approximate index hashes each text block alone (not chained), so "
        "the same blocks in another order match",
        "python/pdserve/router/approx_index.py",
        "hashlib.blake2b(h.to_bytes(8, \"little\") + chunk, digest_size=8)",
        "hashlib.blake2b(chunk, digest_size=8)",
        ("test/router/test_router_approx_index.py::test_blocks_are_chained_so_order_matters[text]",)),
    Mutation(
        "router_token_blocks_unchained", "page hashes (the router's for a prompt's tokens, as the servers') each "
        "hash their page alone, not chained",
        "python/pdserve/mem/radix_cache.py",
        "            m.update(pack(h, *block))\n",
        "            m.update(pack(parent_hash, *block))\n",
        ("test/router/test_router_approx_index.py::test_blocks_are_chained_so_order_matters[tokens]",)),
    Mutation(
        "nixl_notify_unbounded", "a NIXL receiver keeps a notify of any size",
        NIXL,
        "name, msg = json.loads(payload) if len(payload) <= MAX_NOTIFY_BYTES else (None, None)",
        "name, msg = json.loads(payload)",
        (f"{T_TRANSFER}::test_nixl_drops_a_notify_over_the_size_bound_and_still_lands_its_data",)),
    # issue 32, structured output flow
    Mutation(
        "thinking_end_token_fed_to_grammar", "the token that ends a thinking part is also fed to the grammar, "
        "which refuses it: the request aborts right after </think>",
        GRAMMAR,
        "                r.grammar.accept_token(tokens[i])\n        if rows:\n",
        "                r.grammar.accept_token(tokens[i])\n        rows = self._rows(reqs)\n        if rows:\n",
        (f"{T_GRAMMAR}::test_a_thinking_part_is_free_then_the_grammar_holds[sampled]",)),
    Mutation(
        "forced_call_invents_arguments", "a forced call cut before its arguments began reports \"{}\"",
        "python/pdserve/parsers/json_array.py",
        "ARGUMENT_KEYS, complete=False)",
        "ARGUMENT_KEYS, complete=final)",
        ("test/parsers/test_json_array.py",)),
    Mutation(
        "json_string_control_chars", "xgrammar's converted JSON-schema grammar is compiled as it comes: its "
        "min/maxLength strings let raw control characters (U+0000-U+001F) into the output (issue 32)",
        "python/pdserve/constrained/xgrammar_backend.py",
        "    return _EBNF_LITERAL_OR_CLASS.sub(fix, ebnf)\n",
        "    return ebnf\n",
        ("test/constrained/test_json_strings.py::test_every_token_the_grammar_allows_is_valid_json_there"
         "[xgrammar-byte_level-False]",
         "test/engine/test_json_fuzz.py::test_every_sample_is_strict_json_valid_under_its_schema"
         "[xgrammar-byte_fallback]")),
    Mutation(
        "xgrammar_batch_fill_without_utf8_guard", "the batched mask fill skips the UTF-8 guard: xgrammar lets "
        "an encoded surrogate through, which the client reads as three U+FFFD (a maxLength broken)",
        "python/pdserve/constrained/xgrammar_backend.py",
        "        bitmask[rows] &= self.guard.masks[[g.states[-1] for g in mine]]  # Utf8Guard: [R, W]\n",
        "",
        ("test/engine/test_json_fuzz.py::test_every_sample_is_strict_json_valid_under_its_schema"
         "[xgrammar-byte_level]",)),
    # issue 34: DeepSeek-V3.2 (MLA + DSA)
    Mutation(
        "v32_index_keys_not_stored", "DeepSeek-V3.2's index keys are never written to the pool, so later "
        "chunks and decode steps score zeros for every earlier token",
        "python/pdserve/layers/attention/torch_native.py",
        "        pool.set_index_k(layer_id, fb.out_cache_loc, index.k)\n", "",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v32_indexer_sees_the_next_token", "the indexer's causal mask lets a query select the token after it",
        "python/pdserve/layers/attention/torch_native.py",
        "                visible = None if md.sees_all else md.row_mask[:, 0, q0:q0 + step, :L]  # [B, q, L]\n",
        "                visible = md.row_mask[:, 0, q0:q0 + step, :L]\n"
        "                visible = visible | visible.roll(1, -1)\n",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",
         "test/models/test_deepseek_v32.py::test_cpu_kernel_and_torch_twin_give_the_same_logprobs")),
    Mutation(
        "v32_topk_kernel_sees_one_more", "the indexer's score kernel lets a query pick the token just past what it "
        "sees (its top-k boundary off by one: the next token in an extend, a padding slot in decode)",
        "kernels/pdserve_kernels/sparse_mla.py", "    valid = offs < vis\n", "    valid = offs <= vis\n",
        ("test/kernels/test_sparse_mla_kernels.py::test_index_topk_matches_twin[interp-1]",
         "test/layers/test_triton_sparse.py::test_triton_sparse_mla_matches_torch_native[1]")),
    Mutation(
        "v32_topk_kernel_keeps_one_less", "index_topk keeps index_topk - 1 tokens per query",
        "kernels/pdserve_kernels/sparse_mla.py", "    k = min(topk, L)\n", "    k = min(topk - 1, L)\n",
        ("test/kernels/test_sparse_mla_kernels.py::test_index_topk_matches_twin[interp-1]",)),
    Mutation(
        "v32_topk_twin_keeps_one_less", "the top-k twin drops each query's last pick (kernel and twin disagree)",
        "kernels/pdserve_kernels/sparse_mla_ref.py", "        best = topk_first_on_ties(score, min(k, n))\n",
        "        best = topk_first_on_ties(score, min(k, n) - 1)\n",
        ("test/kernels/test_sparse_mla_kernels.py::test_index_topk_matches_twin[interp-16]",)),
    Mutation(
        "v32_torch_native_keeps_one_less", "torch_native's indexer keeps index_topk - 1 tokens per query",
        "python/pdserve/layers/attention/torch_native.py",
        "    chosen = topk_first_on_ties(score, min(topk, L))  # [B, Q, k]",
        "    chosen = topk_first_on_ties(score, min(topk, L) - 1)  # [B, Q, k]",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",
         "test/layers/test_triton_sparse.py::test_triton_sparse_mla_matches_torch_native[16]",
         "test/kernels/test_index_topk_cpu.py::test_ties_at_the_cut_go_to_the_lowest_positions")),
    Mutation(
        "v32_topk_ties_by_chance", "torch_native's indexer leaves ties at the top-k cut to torch.topk, so a verify's "
        "rows and a decode's row keep different zero-scored tokens",
        "python/pdserve/layers/attention/torch_native.py",
        "    chosen = topk_first_on_ties(score, min(topk, L))  # [B, Q, k]",
        "    chosen = score.topk(min(topk, L), dim=-1, sorted=False).indices  # [B, Q, k]",
        ("test/models/test_deepseek_v32.py::test_fp8_preset_serves_with_nextn[100]",
         "test/kernels/test_index_topk_cpu.py::test_ties_at_the_cut_go_to_the_lowest_positions")),
    Mutation(
        "v32_topk_shortcut_through_a_tie", "the CPU top-k keeps topk's own picks even where the (k+1)-th largest "
        "ties the k-th, so which tied token is kept is left to torch.topk",
        "kernels/pdserve_kernels/sparse_mla_ref.py",
        "    clear = low.values[..., 0] < low.values[..., 1]  # [...]",
        "    clear = low.values[..., 0] <= low.values[..., 1]  # [...]",
        ("test/kernels/test_sparse_mla_kernels.py::test_topk_without_a_tie_at_the_cut_keeps_the_l_wide_rules_picks[3]",
         "test/kernels/test_sparse_mla_kernels.py::test_only_the_rows_tied_at_the_cut_take_the_rule")),
    Mutation(
        "v32_tie_scan_restarts", "a tied row's scan for its tied scores starts every chunk from position 0 again, "
        "so it keeps the same tied tokens twice",
        "kernels/pdserve_kernels/sparse_mla_ref.py", "        start, size = stop, 2 * size\n",
        "        start, size = 0, 2 * size\n",
        ("test/kernels/test_sparse_mla_kernels.py::test_the_tie_scan_over_chunks_keeps_the_l_wide_rules_picks[1]",)),
    # issue 33: cache privacy (keyed block hashes, worker-only snapshot, cache_salt, rooms)
    Mutation(
        "kv_block_hash_unkeyed", "the block hash chain ignores the deployment's key (a dictionary attack works)",
        "python/pdserve/mem/radix_cache.py",
        "    base = hashlib.blake2b(digest_size=8, key=key)\n",
        "    base = hashlib.blake2b(digest_size=8)\n",
        ("test/obs/test_cache_privacy.py::test_keyed_hashes_give_nothing_without_the_key",)),
    Mutation(
        "snapshot_takes_the_inference_key", "/kv_events/snapshot opens to the inference key again",
        "python/pdserve/web/api_key.py",
        "    \"/kv_events/snapshot\": Access.WORKER,",
        "    \"/kv_events/snapshot\": Access.INFERENCE,",
        ("test/web/test_api_key.py::test_the_snapshot_is_a_worker_only_route",)),
    Mutation(
        "unkeyed_events_beyond_loopback", "an unkeyed server publishes its block hashes beyond loopback",
        "python/pdserve/obs/kv_event_publisher.py",
        "        if not self.token_ids and self.curve is None:\n            self.close()",
        "        if False:\n            self.close()",
        ("test/obs/test_kv_event_publisher.py::test_unkeyed_hashes_are_not_published_beyond_this_machine",)),
    Mutation(
        "cache_salt_ignored_on_match", "a request matches the default tree whatever its cache_salt",
        "python/pdserve/mem/radix_cache.py",
        "        node = self._root_for(salt)\n        pages: list[int] = []",
        "        node = self._root_for(\"\")\n        pages: list[int] = []",
        ("test/mem/test_radix_cache.py::test_different_salts_never_share_a_prefix_page",)),
    Mutation(
        "rooms_from_mt19937", "bootstrap rooms come from Python's MT19937 again",
        "python/pdserve/disagg/bootstrap.py",
        "    return secrets.randbits(ROOM_BITS)",
        "    return __import__(\"random\").getrandbits(ROOM_BITS)",
        ("test/disagg/test_bootstrap_fields.py::test_rooms_do_not_follow_the_python_random_state",)),
    Mutation(
        "index_shard_outside_the_model", "a checkpoint index's ../ shard names are loaded",
        "python/pdserve/models/loader.py",
        'any(p in ("..", ".") for p in parts)',
        "False",
        ("test/models/test_loader.py::test_index_entries_outside_the_model_directory_are_refused",)),
    # issue 34: V3.2's index keys through P/D and the tiers
    Mutation(
        "v32_index_keys_not_transferred", "the P/D plan writes the kind's own buffers only, so V3.2's index keys "
        "(a region of the latent's pages) never reach decode",
        "python/pdserve/disagg/layout.py",
        "    for layer in layers:\n        for buffer in src.layer_buffers(layer):\n            for g in segs:",
        "    for layer in layers:\n        for buffer in BUFFERS[src.kind]:\n            for g in segs:",
        ("test/disagg/test_layout.py::test_index_keys_move_with_the_latent_from_the_random_source_rank",
         "test/disagg/test_pd_deepseek_v32.py::test_greedy_tokens_match_transformers_through_the_router[mooncake]")),
    Mutation(
        "v32_index_keys_not_restored_on_host_hit", "a load from the host tier copies a page's first buffer (the "
        "latent) back but not its index keys, so a host hit scores stale keys",
        "python/pdserve/mem/host_pool.py",
        "                else:\n"
        "                    dev[:, d].copy_(self._host_page(host, s), non_blocking=non_blocking)",
        "                elif host is self.buffers[0]:\n"
        "                    dev[:, d].copy_(self._host_page(host, s), non_blocking=non_blocking)",
        ("test/mem/test_hicache.py::test_host_pool_round_trips_pages_and_payloads[mla+index_k-layer_first]",
         "test/models/test_deepseek_v32.py::test_host_tier_hit_restores_the_index_keys")),
    # issue 34: DeepSeek-V3.2's indexer (scores, top-k), its MTP layer and FP8 checkpoints
    Mutation(
        "v32_index_topk_one_more", "the indexer keeps index_topk + 1 tokens per query (its top-k boundary off by one)",
        "python/pdserve/models/deepseek_v32.py",
        "        self.topk = int(c.index_topk)\n", "        self.topk = int(c.index_topk) + 1\n",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v32_index_score_without_relu", "the indexer sums raw q.k over its heads: the ReLU dropped",
        "python/pdserve/layers/attention/torch_native.py",
        "    s = torch.relu_(s).view(B, Q, Hi, L)",
        "    s = s.view(B, Q, Hi, L)",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",
         "test/models/test_deepseek_v32.py::test_cpu_kernel_and_torch_twin_give_the_same_logprobs")),
    Mutation(
        "v32_index_head_weights_dropped",
        "the indexer sums its heads unweighted (weights_proj's per-head weights dropped)",
        "python/pdserve/models/deepseek_v32.py",
        "        weights = self.weights_proj(x.float()) * self.n_heads ** -0.5  # [T, Hi]\n",
        "        weights = torch.ones_like(self.weights_proj(x.float()))  # [T, Hi]\n",
        ("test/models/test_deepseek_v32.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v32_mtp_layer_dense", "the NEXTN draft of DeepSeek-V3.2 is a dense MLA layer: its own indexer is never built",
        "python/pdserve/models/draft.py",
        "        attention = target.attention_class(c, layer_id, SINGLE.attention, dtype)\n",
        "        attention = DeepseekV2ForCausalLM.attention_class(c, layer_id, SINGLE.attention, dtype)\n",
        ("test/models/test_deepseek_v32.py::test_nextn_loads_the_mtp_layers_own_indexer",
         "test/models/test_deepseek_v32.py::test_nextn_keeps_greedy_output_equal_to_plain_decoding_and_transformers")),
    Mutation(
        "v32_fp8_indexer_left_unquantized", "our FP8 quantizer leaves the indexer's wq_b/wk in full precision (the "
        "FP8 preset and test checkpoints would not exercise the checkpoint's indexer scales)",
        "python/pdserve/layers/quant/fp8.py", "                                   \"wq_b\", \"wk\"})", "})",
        ("test/models/test_deepseek_v32.py::test_fp8_checkpoint_quantizes_the_indexers_wq_b_and_wk_only",
         "test/models/test_deepseek_v32.py::test_fp8_preset_loads_the_full_presets_draws_quantized")),
    # issue 35: DeepSeek-V4 (sliding window, CSA, HCA over per-token regions)
    Mutation(
        "v4_window_not_applied", "DeepSeek-V4's queries see raw rows older than the sliding window",
        "python/pdserve/models/deepseek_v4_attention.py",
        " & (kpos[None, :] > qpos[:, None] - self.W)", "",
        ("test/models/test_deepseek_v4.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v4_entry_offset_by_one_block", "a compressed entry is rotated at the next block's first position",
        "python/pdserve/models/deepseek_v4_attention.py",
        "self.rope, start)  # rope at the window's start", "self.rope, start + m)",
        ("test/models/test_deepseek_v4.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v4_overlap_slice_dropped", "CSA's entries never pool the previous window's first series (the "
        "reference's open-window overlap state)",
        "python/pdserve/models/deepseek_v4_attention.py",
        "        has_prev = start > 0\n", "        has_prev = start < 0\n",
        ("test/models/test_deepseek_v4.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    # issue 35: DeepSeek-V4's regions through P/D and the tiers (v4_pd_not_refused went with the refusal)
    Mutation(
        "v4_region_not_transferred", "the P/D plan skips every region kept by only some layers (V4's compressor "
        "sources, compressed entries and index keys): both sides agree on the shorter count, decode reads stale rows",
        "python/pdserve/disagg/layout.py",
        "                return r.layers.index(layer) if layer in r.layers else None",
        "                return None",
        ("test/disagg/test_layout.py::test_every_region_moves_on_the_layers_keeping_it_from_the_random_source_rank",
         "test/disagg/test_pd_deepseek_v4.py::test_greedy_tokens_match_transformers_through_the_router[mooncake]")),
    Mutation(
        "v4_region_not_restored_on_host_hit", "a load from the host tier restores only the buffers every layer "
        "keeps, so V4's compressed regions on a host hit are the device page's stale rows",
        "python/pdserve/mem/host_pool.py",
        "                else:\n"
        "                    dev[:, d].copy_(self._host_page(host, s), non_blocking=non_blocking)",
        "                elif dev.shape[0] == self.device_pool.num_layers:\n"
        "                    dev[:, d].copy_(self._host_page(host, s), non_blocking=non_blocking)",
        ("test/models/test_deepseek_v4.py::test_host_tier_hits_resume_at_reusable_boundaries",)),
    # issue 35: DeepSeek-V4's FP4 experts
    Mutation(
        "v4_fp4_nibble_order_swapped", "an FP4 byte's high nibble is read as the even column (DeepSeek packs "
        "column 2j in the low nibble)",
        "python/pdserve/layers/quant/fp4.py", "torch.stack([u8 & 0xF, u8 >> 4], dim=-1)",
        "torch.stack([u8 >> 4, u8 & 0xF], dim=-1)",
        ("test/layers/quant/test_fp4.py::test_hand_made_bytes_decode_nibble_by_nibble",
         "test/models/test_deepseek_v4.py::test_fp4_checkpoint_decodes_like_transformers_on_the_dequantized_copy")),
    Mutation(
        "v4_fp4_scale_bias_off_by_one", "ue8m0 scales decode as 2^(byte - 126): every FP4 expert twice too large",
        "python/pdserve/layers/quant/fp4.py", "per_col = (exps.float() - UE8M0_BIAS).exp2()",
        "per_col = (exps.float() - UE8M0_BIAS + 1).exp2()",
        ("test/layers/quant/test_fp4.py::test_hand_made_bytes_decode_nibble_by_nibble",
         "test/models/test_deepseek_v4.py::test_fp4_checkpoint_decodes_like_transformers_on_the_dequantized_copy")),
    # issue 35: DeepSeek-V4's MTP layer (NEXTN)
    Mutation(
        "v4_mtp_skips_hyper_connections", "DeepSeek-V4's MTP layer runs its MoE as a plain residual on the mean "
        "of its streams: no mHC mix, no attention",
        "python/pdserve/models/deepseek_v4_mtp.py",
        "        return DeepseekV4DecoderLayer.forward(self, h, fb).flatten(1)  # [T, n Hd]\n",
        "        return (h + self.mlp(self.post_attention_layernorm(h.mean(1)), fb.input_ids).unsqueeze(1))"
        ".flatten(1)\n",
        ("test/models/test_deepseek_v4.py::test_mtp_layer_matches_its_definition_over_transformers_modules",)),
    Mutation(
        "v4_mtp_state_in_target_layer", "DeepSeek-V4's MTP layer writes its window rows into the target's last "
        "layer instead of the pool's extra layer",
        "python/pdserve/models/deepseek_v4_mtp.py",
        "        layer_id = c.num_hidden_layers\n", "        layer_id = c.num_hidden_layers - 1\n",
        ("test/models/test_deepseek_v4.py::test_nextn_keeps_greedy_output_equal_to_plain_decoding_and_transformers",)),
    Mutation(
        "overlap_streams_the_lagged_step", "a request that ended one step earlier still gets the in-flight step's "
        "token (overlap scheduling's one-step lag ignored)",
        SCHED,
        "        live = [i for i, r in enumerate(reqs) if not r.finished]",
        "        live = list(range(len(reqs)))",
        ("test/engine/test_overlap.py::test_a_finished_request_gets_no_token_from_the_step_in_flight",)),
    Mutation(
        "overlap_frees_pages_under_the_step_in_flight", "a request that ends while the step in flight holds it "
        "frees its pages at once (that step's late write may land on their next owner's KV)",
        SCHED,
        "        if self._inflight is not None and self._inflight.row_of(req) >= 0:\n"
        "            self._inflight.ended.append(req)\n            return\n",
        "",
        ("test/engine/test_overlap.py::test_pages_of_a_request_ended_under_the_step_in_flight_stay_taken_until_it_lands",)),
    # issue 35: DeepSeek-V4's state kinds (compressed regions at their rate, the bounded layout's records)
    Mutation(
        "v4_open_window_dropped_in_transfer", "P/D leaves out the compressors' source rows (the open-window rings "
        "of the bounded layout's record): both sides agree on the shorter count, decode pools windows from stale rows",
        "python/pdserve/disagg/layout.py",
        "                return r.layers.index(layer) if layer in r.layers else None",
        "                return r.layers.index(layer) if layer in r.layers and not r.name.endswith('_src') else None",
        ("test/disagg/test_pd_deepseek_v4.py::test_greedy_tokens_match_transformers_through_the_router[mooncake]",)),
    Mutation(
        "v4_window_not_trimmed", "the bounded layout's window ring keeps every position of the context instead of "
        "the last W - 1 (a request's window memory grows with its length)",
        "python/pdserve/config.py",
        '    rings, tails = {"window_kv": W - 1}, {"window_kv": W - 1}',
        '    rings, tails = {"window_kv": int(c.max_position_embeddings)}, {"window_kv": W - 1}',
        ("test/models/test_deepseek_v4.py::test_bounded_state_is_a_fifth_of_v3_at_64k",)),
    Mutation(
        "v4_compressed_entry_kept_one_block_early", "a compressed entry is kept in the row of the entry before it "
        "(one block early), so every read sees its neighbour's entry",
        "python/pdserve/models/deepseek_v4_attention.py",
        'io.pool.set_rows(name, self.layer_id, fb.kv_slots[b, closing], entries)',
        'io.pool.set_rows(name, self.layer_id, fb.kv_slots[b, (closing - m).clamp(min=0)], entries)',
        ("test/models/test_deepseek_v4.py::test_greedy_tokens_and_logprobs_match_transformers",)),
    Mutation(
        "v4_prefix_hit_at_non_reusable_boundary", "the radix cache gives a hit at any page boundary, where the "
        "bounded layout keeps no window or open-window state to continue from",
        "python/pdserve/mem/radix_cache.py",
        "            del pages[len(pages) // self.reuse_pages * self.reuse_pages:]\n",
        "",
        ("test/models/test_deepseek_v4.py::test_prefix_hits_give_identical_output",)),
    Mutation(
        "progress_nonce_unchecked", "decode extends a room's wait on a progress notice with the wrong nonce",
        "python/pdserve/disagg/decode.py",
        "        if not self._current(p.room, p.nonce):\n",
        "        if p.room not in self.rooms:\n",
        (f"{T_PD}::test_a_forged_or_stale_progress_notice_extends_nothing[memory]",)),
    Mutation(
        "prefill_deadline_on_send", "prefill extends its write deadline when it sends a progress notice, not when "
        "decode acknowledges it (a lost notice lets prefill write past decode's wait)",
        "python/pdserve/disagg/prefill.py",
        "            n.last = n.sent[self._notice_seq] = now\n",
        "            n.last = n.sent[self._notice_seq] = now\n            self.sender.extend(room, now, t)\n",
        (f"{T_PD}::test_a_notice_decode_never_accepted_extends_no_deadline[memory]",)),
    Mutation(
        "no_progress_notices", "prefill never reports progress: a prefill longer than the timeout falls back",
        "python/pdserve/disagg/prefill.py",
        "        self._notify_progress(now)\n",
        "",
        (f"{T_PD}::test_a_prefill_slower_than_the_timeout_lands_its_kv_while_it_reports_progress[memory]",)),
    # issue 35: DeepSeek-V4's bounded layout across P/D (the per-request record moves beside the pages)
    Mutation(
        "v4_record_not_transferred", "prefill never posts the request's record writes (window and open-window "
        "rings): decode's count is short, every room falls back",
        "python/pdserve/disagg/sender.py",
        "            if last and self.layout.records:\n                if row is None:",
        "            if False:\n                if row is None:",
        ("test/disagg/test_pd_deepseek_v4.py::test_nextn_1p1d_matches_transformers_and_moves_the_draft_layer",)),
    Mutation(
        "v4_record_neither_sent_nor_counted", "no layer keeps a record in the transfer plan: both sides agree on "
        "the shorter count, decode continues from a ring prefill never wrote",
        "python/pdserve/disagg/layout.py",
        "        return tuple(r.name for r in self.records if self.row(r.name, layer) is not None)",
        "        return ()",
        ("test/disagg/test_pd_deepseek_v4.py::test_nextn_1p1d_matches_transformers_and_moves_the_draft_layer",)),
    Mutation(
        "v4_record_row_not_quarantined", "decode gives up on a room but frees its table row at once, while a late "
        "write may still land on the row's record",
        "python/pdserve/disagg/decode.py",
        "own = self.scheduler.kv_manager.quarantine(req, keep_row=records)",
        "own = self.scheduler.kv_manager.quarantine(req)",
        ("test/disagg/test_pd_deepseek_v4.py::test_a_record_left_out_is_short_of_decodes_count_and_falls_back",)),
    Mutation(
        "v4_tier_hit_at_non_reusable_boundary", "the hierarchical cache loads a host continuation that ends "
        "inside a block, where the bounded layout keeps no tails to resume from",
        "python/pdserve/mem/hiradix_cache.py",
        "        end = match.num_pages // self.reuse_pages * self.reuse_pages\n",
        "        end = match.num_pages\n",
        ("test/models/test_deepseek_v4.py::test_host_tier_hits_resume_at_reusable_boundaries",)),
    Mutation(
        "v4_tier_tail_rows_not_stored", "pages go down to host memory (and so to storage) without their "
        "boundary tail rows",
        "python/pdserve/mem/host_pool.py",
        "        for (_, dev), host in zip(self.device_pool.page_buffers(), self.buffers):\n",
        "        for (name, dev), host in zip(self.device_pool.page_buffers(), self.buffers):\n"
        "            if to_host and name.endswith('_tail'):\n                continue\n",
        ("test/models/test_deepseek_v4.py::test_host_tier_hits_resume_at_reusable_boundaries",
         "test/models/test_deepseek_v4.py::test_storage_tier_hit_resumes_at_a_reusable_boundary[file]")),
    Mutation(
        "v4_partial_block_cached", "a request that ends inside a reusable block caches that block's first "
        "pages, whose tail rows were never written",
        "python/pdserve/mem/cache_manager.py",
        "        full = cache_len // self.page_size // self.cache.reuse_pages * self.cache.reuse_pages\n",
        "        full = cache_len // self.page_size\n",
        ("test/models/test_deepseek_v4.py::test_a_block_cached_whole_and_a_short_resume_from_its_tails",)),
    Mutation(
        "v4_short_resume_ring_not_filled", "a step resumed from a boundary's tails leaves the tail rows out of "
        "its ring, so a step shorter than the window reads stale rows next",
        "python/pdserve/mem/region_pool.py",
        "        if not self.from_ring and self.p0 and region in self.bounded.tails:\n",
        "        if False:\n",
        ("test/models/test_deepseek_v4.py::test_a_block_cached_whole_and_a_short_resume_from_its_tails",
         "test/models/test_deepseek_v4.py::test_a_step_shorter_than_the_tail_after_a_boundary_hit")),
    Mutation(
        "index_topk_cpu_tie_to_later_position", "the CPU indexer kernel lets a later score equal to its k-th "
        "best replace it: ties at the cut go to the highest positions, not the twin's lowest",
        "kernels/pdserve_kernels/index_topk_cpu.c",
        "            } else if (s > h[0].s) {\n",
        "            } else if (s >= h[0].s) {\n",
        ("test/kernels/test_index_topk_cpu.py::test_picks_match_twin",
         "test/kernels/test_index_topk_cpu.py::test_ties_at_the_cut_go_to_the_lowest_positions")),
    Mutation(
        "index_topk_cpu_scores_past_visible", "the CPU indexer kernel scores one token past what a query "
        "sees (an extend's query picks its own successor)",
        "kernels/pdserve_kernels/index_topk_cpu.c",
        "            if (j >= vis[t]) continue;\n",
        "            if (j > vis[t]) continue;\n",
        ("test/kernels/test_index_topk_cpu.py::test_picks_match_twin",)),
    # a frontend without torch (the serve start-up's CPU)
    Mutation(
        "frontend_builds_model_config", "serve's frontend builds the transformers-backed ModelConfig again "
        "(its config classes import torch)",
        "python/pdserve/entrypoints/cli.py",
        "    model_files = args.model_files()\n",
        "    model_files = args.model_config().files\n",
        ("test/entrypoints/test_frontend_imports.py::test_the_frontend_of_a_served_model_imports_no_torch",)),
    Mutation(
        "cuda_probe_always_imports_torch", "the default --device probe imports torch on a host without a GPU driver",
        "python/pdserve/config.py",
        '    if sys.platform == "linux" and not any(os.path.exists(f) for f in GPU_DEVICE_FILES):\n',
        '    if False:\n',
        ("test/test_config.py::test_the_cuda_probe_imports_torch_only_where_a_gpu_driver_is",
         "test/entrypoints/test_frontend_imports.py::test_the_frontend_of_a_served_model_imports_no_torch")),
    Mutation(
        "model_files_miss_an_expert_alias", "the start-up checks read Qwen3-MoE's experts (num_local_experts in its "
        "config.json) as none, so --ep-size is refused on it",
        "python/pdserve/config.py",
        '    return getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None) or \\\n'
        '        getattr(c, "num_local_experts", None) or 0\n',
        '    return getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None) or 0\n',
        ("test/test_config.py::test_the_frontends_model_files_agree_with_the_model_config[tiny-qwen3-moe]",)),
    Mutation(
        "engine_keeps_spinning_waits", "pdserve.Engine never sets passive OpenMP waits before its import loads "
        "torch, so the offline tuner's probes of two threads collapse",
        "python/pdserve/__init__.py",
        "        passive_waits_before_torch()  # before the import below loads torch (and OpenMP with it)\n",
        "        pass\n",
        ("test/engine/test_thread_tuner.py::test_the_engine_gets_passive_waits_only_when_it_loads_torch",)),
    Mutation(
        "stage_hole_filled_from_wrong_row", "when the decode batch shrinks, a staying request past the new size "
        "moves into its hole from the row before its own",
        STAGE,
        "                buf.index_copy_(0, plan.move_dst, buf.index_select(0, plan.move_src))\n",
        "                buf.index_copy_(0, plan.move_dst, buf.index_select(0, plan.move_src - 1))\n",
        ("test/layers/test_attention.py::test_decode_stage_keeps_rows_and_attention_maps_the_order",
         "test/layers/test_attention.py::test_staged_decode_through_swaps_matches_a_fresh_stage_and_the_reference")),
    Mutation(
        "fp8_index_key_scale_not_applied", "DeepSeek-V3.2's FP8 index keys are read back without their block "
        "scales (raw e4m3 values scored)",
        "python/pdserve/mem/kv_pool.py",
        "    return (q.float().unflatten(-1, (blocks, -1)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)\n",
        "    return q.float().to(dtype)\n",
        ("test/models/test_deepseek_v32_fp8_index.py::test_representable_values_round_trip_exactly_and_scales_are_"
         "amax_over_448",
         "test/models/test_deepseek_v32_fp8_index.py::test_greedy_output_equals_transformers_with_fp8_index_keys")),
    Mutation(
        "triton_fp8_index_key_scale_not_applied", "the Triton indexer scores FP8 index keys without their block "
        "scales",
        "kernels/pdserve_kernels/sparse_mla.py",
        "        k = k.to(tl.float32) * ks\n",
        "        k = k.to(tl.float32)\n",
        ("test/layers/test_triton_sparse.py::test_triton_and_torch_native_agree_on_fp8_index_keys",)),
    Mutation(
        "fp8_index_key_scales_not_a_page_region", "DeepSeek-V3.2's FP8 index-key scales are left out of the pool's "
        "page buffers, so P/D and the tiers move keys without their scales",
        "python/pdserve/mem/kv_pool.py",
        '            regions.append(("index_k_scale", self.index_k_scale))\n',
        '            pass\n',
        ("test/models/test_deepseek_v32_fp8_index.py::test_host_tier_hit_restores_fp8_keys_and_scales",
         "test/disagg/test_pd_deepseek_v32.py::test_fp8_index_keys_move_with_their_scales")),
    Mutation(
        "fused_rmsnorm_without_eps", "the fused CPU RMSNorm leaves eps out of rsqrt(mean(x^2) + eps)",
        "kernels/pdserve_kernels/fused_cpu.c",
        "    float inv = 1.f / sqrtf(ss / (float)X + eps);\n",
        "    float inv = 1.f / sqrtf(ss / (float)X);\n",
        ("test/kernels/test_fused_cpu.py::test_rmsnorm_eps_counts_on_small_and_zero_rows",)),
    Mutation(
        "decode_attention_cpu_wrong_kv_head", "the CPU decode attention kernel reads the next KV head's keys and "
        "values for a group of query heads (h + 1, not h // G)",
        "kernels/pdserve_kernels/decode_attention_cpu.c",
        "n - j0 < BLOCK ? n - j0 : BLOCK, h, jb->q + (b * Hq + h * G) * Dk,\n",
        "n - j0 < BLOCK ? n - j0 : BLOCK, (h + 1) % Hkv, jb->q + (b * Hq + h * G) * Dk,\n",
        ("test/kernels/test_decode_attention_cpu.py::test_matches_twin_and_sdpa",
         "test/models/test_model_parity.py::test_decode_through_the_cpu_kernel_matches_transformers")),
    Mutation(
        "decode_attention_cpu_no_rescale", "the CPU decode attention kernel's online softmax does not shrink the "
        "running output when a later block raises the max (earlier blocks' values weigh too much)",
        "kernels/pdserve_kernels/decode_attention_cpu.c",
        "            scale_row(o + g * Dv, a, Dv);\n",
        "            (void)a;\n",
        ("test/kernels/test_decode_attention_cpu.py::test_matches_twin_and_sdpa",
         "test/kernels/test_decode_attention_cpu.py::test_large_scores_stay_finite")),
    Mutation(
        "decode_attention_cpu_unit_drops_a_request", "a unit the CPU decode kernel's helper threads claim leaves "
        "out its last request (its output rows never written)",
        "kernels/pdserve_kernels/decode_attention_cpu.c",
        "    int64_t b0 = i * jb->per_unit, b1 = b0 + jb->per_unit;\n",
        "    int64_t b0 = i * jb->per_unit, b1 = b0 + jb->per_unit - (jb->per_unit > 1);\n",
        ("test/kernels/test_decode_attention_cpu.py::test_helper_threads_give_the_same_bits",)),
    Mutation(
        "ragged_fresh_request_reads_its_neighbours_rows", "a ragged extend's request with no prefix attends over this "
        "step's K/V rows one request late (the previous request's rows where it has one)",
        "python/pdserve/layers/attention/torch_native.py",
        "                k, v = (t[r.start:r.start + r.ext].transpose(0, 1).unsqueeze(0).to(q.dtype) for t in new)\n",
        "                k, v = (t[max(0, r.start - 1):max(0, r.start - 1) + r.ext].transpose(0, 1).unsqueeze(0)"
        ".to(q.dtype) for t in new)\n",
        ("test/layers/test_attention.py::test_mixed_length_extend_matches_each_request_alone",)),
    Mutation(
        "gemm_cpu_k_loop_drops_the_last_feature", "the C small-M GEMM's microkernel sums x[m, k] W[n, k] over "
        "k < K - 1 (the last input feature never counted)",
        "kernels/pdserve_kernels/gemm_cpu.c",
        "    for (int64_t k = 0; k < K; k++) {\n",
        "    for (int64_t k = 0; k < K - 1; k++) {\n",
        ("test/kernels/test_gemm_cpu.py::test_matches_f_linear",)),
    Mutation(
        "decode_stack_kv_written_at_the_next_slot", "the one-call decode stack writes each request's new k and v "
        "one row past its slot in the page (the attention then reads a stale row, the pool keeps a wrong one)",
        "kernels/pdserve_kernels/decode_stack_cpu.c",
        "        const int64_t page = loc[b] / d->S, off = loc[b] % d->S;\n",
        "        const int64_t page = loc[b] / d->S, off = (loc[b] + 1) % d->S;\n",
        ("test/kernels/test_decode_stack_cpu.py::test_the_one_call_is_the_layers_bit_for_bit",)),
    Mutation(
        "decode_stack_skips_the_post_attention_residual", "the one-call decode stack normalises the attention "
        "output without adding the residual stream (and the stream's next buffer is never written)",
        "kernels/pdserve_kernels/decode_stack_cpu.c",
        "        pdserve_rmsnorm_f32(out, B, 1, H, H, 0, res, H, 0, ly->post_norm,",
        "        pdserve_rmsnorm_f32(out, B, 1, H, H, 0, NULL, H, 0, ly->post_norm,",
        ("test/kernels/test_decode_stack_cpu.py::test_the_one_call_is_the_layers_bit_for_bit",)),
    Mutation(
        "extend_attention_cpu_sees_one_key_ahead", "the C extend attention's causal bound is off by one: new token "
        "i of a request also sees the key at position prefix + i + 1 (its successor's)",
        "kernels/pdserve_kernels/extend_attention_cpu.c",
        "        t->last[r] = (int32_t)(jb->prefix[b] + i0 + (i < t->nq ? i : t->nq - 1));",
        "        t->last[r] = (int32_t)(jb->prefix[b] + i0 + 1 + (i < t->nq ? i : t->nq - 1));",
        ("test/kernels/test_extend_attention_cpu.py::test_matches_sdpa_and_twin",)),
    Mutation(
        "extend_attention_cpu_tile_reads_the_next_kv_head", "a query tile of the C extend attention reads the next "
        "KV head's keys and values (h + 1), not those of its own query heads' group",
        "kernels/pdserve_kernels/extend_attention_cpu.c",
        "        block_rows(jb, sl + j0, nb, h, kr, vr);\n",
        "        block_rows(jb, sl + j0, nb, (h + 1) % jb->Hkv, kr, vr);\n",
        ("test/kernels/test_extend_attention_cpu.py::test_matches_sdpa_and_twin",)),
    Mutation(
        "extend_attention_cpu_masks_by_the_last_lane", "the C extend attention decides whether a key block needs "
        "the causal mask by the tile's last lane (which sees every key of the tile) rather than its first: "
        "diagonal blocks go unmasked",
        "kernels/pdserve_kernels/extend_attention_cpu.c",
        "    const int masked = j0 + nb - 1 > t->last[0];",
        "    const int masked = j0 + nb - 1 > t->last[t->W - 1];",
        ("test/kernels/test_extend_attention_cpu.py::test_matches_sdpa_and_twin",)),
    Mutation(
        "extend_attention_cpu_sum_not_rescaled", "the C extend attention's online softmax rescales the output "
        "accumulator on a new running max but not the running sum",
        "kernels/pdserve_kernels/extend_attention_cpu.c",
        "    vstore(t->l + c, vload(t->l + c) * a + sum);",
        "    vstore(t->l + c, vload(t->l + c) + sum);",
        ("test/kernels/test_extend_attention_cpu.py::test_matches_sdpa_and_twin",)),
    Mutation(
        "decode_forgets_an_early_lost_notice", "a decode server drops the router's prefill-lost notice for a room "
        "whose request has not arrived yet: the request then waits out the disaggregation timeout for KV that "
        "will never come",
        "python/pdserve/disagg/decode.py",
        "        lost = self._lost_early_notice(bootstrap.room)\n",
        "        lost = None\n",
        ("test/disagg/test_bootstrap_routed.py::test_a_room_lost_before_its_request_arrives_is_prefilled_locally_"
         "as_it_arrives",)),
    Mutation(
        "decode_stack_ignores_the_layer_hook", "the one-call decode stack runs a step that has a layer hook (P/D's "
        "per-layer announcements): every layer's KV is written before the first is announced",
        "python/pdserve/models/fused_decode.py",
        "fb.dp_num_tokens is None and fb.layer_hook is None",
        "fb.dp_num_tokens is None",
        ("test/engine/test_scheduler.py::test_layer_hook_runs_after_each_layers_kv_is_written",)),
    Mutation(
        "openai_stream_skips_steps_without_text", "an OpenAI stream sends no event for a step whose tokens hold "
        "no text yet (an incomplete UTF-8 character): a model that keeps emitting such tokens streams nothing "
        "until its last token",
        "python/pdserve/entrypoints/openai_api.py",
        "        elif text or lp is not None or (c.token_ids and not c.finished):\n",
        "        elif text or lp is not None:\n",
        ("test/entrypoints/test_tokenizer_manager.py::test_a_streamed_step_whose_text_is_held_back_still_sends_an_"
         "event",)),
    Mutation(
        "finished_request_released_before_its_tokens_leave", "a request that finishes decoding hands its pages "
        "to the radix cache before the step's outputs are sent: the insert holds back that step's tokens for "
        "every stream",
        "python/pdserve/engine/scheduler_loop.py",
        "            self.scheduler.defer_release = True\n",
        "            self.scheduler.defer_release = False\n",
        ("test/entrypoints/test_scheduler_process.py::test_a_finished_request_gives_its_pages_to_the_cache_after_"
         "its_last_token_is_sent",)),
    Mutation(
        "finished_request_pages_wait_for_the_next_step", "the loop does not release the finished requests after "
        "sending the step's outputs: their pages stay out of the cache and the pool until some later step",
        "python/pdserve/engine/scheduler_loop.py",
        "        if deferred:\n            self.scheduler.release_finished()\n",
        "",
        ("test/entrypoints/test_scheduler_process.py::test_a_finished_request_gives_its_pages_to_the_cache_after_"
         "its_last_token_is_sent",)),
    # task sched2: the scheduler thread's per-decode-step shortcuts
    Mutation(
        "overlap_same_batch_tokens_shifted", "the overlap worker's same-batch shortcut feeds each row the token "
        "the previous step sampled for the row before it",
        "python/pdserve/engine/overlap.py",
        "            fb.input_ids.copy_(self._last_tokens)",
        "            fb.input_ids.copy_(self._last_tokens.roll(1))",
        ("test/engine/test_overlap.py::test_mixed_lengths_chunked_prefill_and_max_tokens_match_the_plain_loop",)),
    Mutation(
        "no_extend_without_waiting", "a step with no request waiting skips admission even while a chunked prefill "
        "has chunks left: the request never finishes its prompt",
        SCHED,
        "        if not self.waiting and self.chunked is None:\n",
        "        if not self.waiting:\n",
        (f"{T_PATHS}::test_a_chunked_prefill_goes_on_with_no_request_waiting",)),
    Mutation(
        "decode_batch_rows_reversed", "the decode batch's one-tensor build reverses the order of the "
        "requests in every list (each request gets another's token, position and slot)",
        "python/pdserve/engine/model_runner.py",
        "torch.tensor((*per_token, *per_req), dtype=torch.int64)",
        "torch.tensor((*per_token, *per_req), dtype=torch.int64).flip(1)",
        ("test/engine/test_model_runner.py",
         "test/engine/test_engine_parity.py::test_changing_decode_batch_matches_transformers")),
    Mutation(
        "prompt_check_fast_path_misses_the_top", "the C-loop prompt check lets an id equal to the vocabulary "
        "size through (the per-id loop refuses it)",
        "python/pdserve/engine/request.py",
        "return not ids or (min(ids) >= 0 and max(ids) < vocab_size)",
        "return not ids or (min(ids) >= 0 and max(ids) <= vocab_size)",
        ("test/engine/test_request.py::test_token_ids_in_range_agrees_with_the_per_id_check",)),
    Mutation(
        "sse_tail_loses_the_usage_event", "the stream's tail (the usage event) is dropped when it goes out in "
        "one write with [DONE]",
        "python/pdserve/web/streaming.py",
        "    yield end + SSE_DONE\n",
        "    yield SSE_DONE\n",
        ("test/web/test_streaming.py::test_sse_events_writes_once_per_item_and_the_tail_with_done",)),
    Mutation(
        "disconnect_asked_once", "the disconnect poll asks once and stops: a client that leaves after its "
        "first second keeps its request running",
        "python/pdserve/web/streaming.py",
        "        else:\n            self.timer = self.loop.call_later(self.poll_s, self._ask)\n",
        "",
        ("test/web/test_streaming.py::test_the_client_is_asked_every_poll_until_the_awaitable_ends_and_never_after",)),
    Mutation(
        "sse_disconnect_not_watched", "the SSE response never acts on the client's disconnect: a stream whose "
        "client left runs to its end (or waits forever on a token) and its request is never aborted",
        "python/pdserve/web/streaming.py",
        "        watch.add_done_callback(lambda _: pump.cancel())\n",
        "",
        ("test/web/test_streaming.py::test_a_client_that_leaves_mid_stream_ends_the_events_and_the_response_returns",
         "test/entrypoints/test_http_server.py::test_a_completions_client_leaving_mid_stream_aborts_its_request")),
    Mutation(
        "sse_swallows_shutdown", "the SSE response swallows a shutdown's cancellation of its task when the "
        "client left at the same moment (the server's cancel then goes unseen)",
        "python/pdserve/web/streaming.py",
        "if not _left(watch) or _cancelling(asyncio.current_task()):",
        "if not _left(watch):",
        ("test/web/test_streaming.py::test_a_shutdown_as_the_client_leaves_still_propagates",)),
    Mutation(
        "router_pool_keeps_idle_connections", "the router's upstream pool keeps idle connections past the "
        "workers' keep-alive: a health probe or request is sent on one as its worker closes it",
        "python/pdserve/router/proxy.py",
        "connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE_S))",
        "connector=aiohttp.TCPConnector(limit=0))",
        ("test/router/test_router_upstream_pool.py",)),
    Mutation(
        "first_chunk_prefill_not_wide", "a wave's first chunk of one short prompt (128-255 tokens) starts at "
        "the layout's one thread, and one such step per wave never fills a window to be probed",
        "python/pdserve/engine/thread_tuner.py",
        "    wide_tokens: int = 128\n",
        "    wide_tokens: int = 256\n",
        ("test/engine/test_thread_tuner.py",)),
    Mutation(
        "engine_freeze_outlives_a_dropped_engine", "an Engine dropped without shutdown() leaves the process's "
        "heap frozen, with whatever garbage (earlier engines' KV pools) was uncollected when it started",
        "python/pdserve/entrypoints/engine.py",
        "            self._thaw = weakref.finalize(self, gc.unfreeze)\n",
        "            self._thaw = weakref.finalize(type(self), gc.unfreeze)\n",
        ("test/entrypoints/test_engine.py::test_an_engine_dropped_without_shutdown_thaws_what_it_froze",)),
)


# ------------------------------------------------------------------ running
def copy_worktree(dst: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the repository, as they are on disk."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(scratch: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """(pytest exit code, its last output lines), with the scratch copy's package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(scratch / "python")}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--timeout={PER_TEST_TIMEOUT_S}", *tests]
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
    return proc.returncode, "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])


def apply(scratch: Path, m: Mutation) -> str | None:
    """Mutate the scratch file in place; returns its original text, or None if the snippet is not there once."""
    path = scratch / m.file
    text = path.read_text() if path.is_file() else ""
    if text.count(m.old) != 1:
        return None
    path.write_text(text.replace(m.old, m.new))
    return text


def check(scratch: Path, m: Mutation) -> tuple[str, float, str]:
    start = time.monotonic()
    original = apply(scratch, m)
    if original is None:
        return "NO SNIPPET", 0.0, f"{m.file}: the old snippet is not there exactly once"
    try:
        rc, tail = run_tests(scratch, m.tests)
    finally:
        (scratch / m.file).write_text(original)
    outcome = {0: "SURVIVED", 1: "caught"}.get(rc, "ERROR")
    return outcome, time.monotonic() - start, tail.splitlines()[-1] if tail else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = ap.parse_args(argv)
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"--only: unknown mutation(s) {sorted(unknown)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n    {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="pdserve-mutation-"))
    try:
        return _run_all(scratch, chosen)
    finally:
        if args.keep:
            print(f"scratch copy kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_all(scratch: Path, chosen: list[Mutation]) -> int:
    copy_worktree(scratch)
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    print(f"baseline: {len(tests)} test ids on the unmutated copy ...", flush=True)
    rc, tail = run_tests(scratch, tests)
    if rc != 0:
        print(f"baseline FAILED (pytest exit {rc}); fix the tests first:\n{tail}")
        return 2
    width = max(len(m.name) for m in chosen)
    print(f"{'mutation':<{width}}  {'outcome':<10}  {'secs':>5}  pytest")
    failed = 0
    for m in chosen:
        outcome, secs, last = check(scratch, m)
        failed += outcome != "caught"
        print(f"{m.name:<{width}}  {outcome:<10}  {secs:5.0f}  {last}", flush=True)
    print(f"{len(chosen) - failed}/{len(chosen)} caught")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
