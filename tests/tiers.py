"""The suite's two tiers. Plain ``pytest`` runs the fast one (a few minutes on 2 cores): every
test but those named here, which take more than about three seconds each on 2 cores (measured
with ``--durations=0``), and but the files marked serial in ``conftest.py`` (judged by
liveness timeouts; one of each kind stays, in ``FAST_SERIAL``). ``pytest --full`` runs
everything, as CI does. The fast tier keeps a training run per strategy, the main example and
the cheap tests of every other file (those of ``test_multihost.py`` but its private
network's own check, and ``test_third_party_transport.py``'s, take a minute or more), so every
module of the package runs in it.

A test named here is a test function or class method (every parametrisation of it).
"""

from __future__ import annotations

#: File -> tests run only by ``pytest --full``.
FULL_ONLY: dict[str, set[str]] = {
    "test_bench_verdicts.py": {
        "test_the_swarm_runs_node_shapes_through_relays_and_keys_them_by_shape",
        "test_the_fault_matrix_names_the_rank_each_fault_hit",
    },
    "test_check.py": {
        "test_tcpstore_and_cli_exit_codes",
    },
    "test_conformance_etcd.py": {
        "TestEtcdChannel::test_a_channel_dropped_unclosed_after_its_coordinator_died_is_collected_without_a_hang",
        "TestEtcdChannel::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestEtcdChannel::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestEtcdChannel::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestEtcdChannel::test_a_connect_that_waits_says_what_it_waits_for",
        "TestEtcdChannel::test_a_connect_to_nothing_keeps_its_timeout",
        "TestEtcdChannel::test_a_frozen_rank_0_holds_no_call_of_another_rank_past_the_liveness_bound",
        "TestEtcdChannel::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestEtcdChannel::test_a_killed_peer_is_noticed_as_soon_as_the_transport_promises",
        "TestEtcdChannel::test_a_rank_declared_lost_is_cut_off_when_it_resumes",
        "TestEtcdChannel::test_a_rank_frozen_in_the_middle_of_its_writes_blocks_no_one",
        "TestEtcdChannel::test_barrier_timeout_says_how_many_arrived",
        "TestEtcdChannel::test_clean_close_is_not_a_loss",
        "TestEtcdChannel::test_concurrent_adds_give_an_exact_count",
        "TestEtcdChannel::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestEtcdChannel::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestEtcdChannel::test_frozen_peer_is_reported_as_peer_lost",
        "TestEtcdChannel::test_full_job_and_taken_rank_are_refused_naming_a_live_holder",
        "TestEtcdChannel::test_gloo_process_group_through_the_channel",
        "TestEtcdChannel::test_killed_peer_is_reported_as_peer_lost",
        "TestEtcdChannel::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestEtcdChannel::test_peer_killed_before_rendezvous_is_reported_as_peer_lost",
        "TestEtcdChannel::test_ranks_are_unique_and_barriers_never_release_early_under_connection_resets",
        "TestEtcdChannel::test_store_is_linearizable_under_kills_freezes_and_connection_resets",
        "TestEtcdChannel::test_the_store_through_node_relays_is_linearizable_under_kills_freezes_and_connection_resets",
    },
    "test_conformance_grpc.py": {
        "TestGrpcChannel::test_a_channel_dropped_unclosed_after_its_coordinator_died_is_collected_without_a_hang",
        "TestGrpcChannel::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestGrpcChannel::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestGrpcChannel::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestGrpcChannel::test_a_connect_that_waits_says_what_it_waits_for",
        "TestGrpcChannel::test_a_connect_to_nothing_keeps_its_timeout",
        "TestGrpcChannel::test_a_frozen_rank_0_holds_no_call_of_another_rank_past_the_liveness_bound",
        "TestGrpcChannel::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestGrpcChannel::test_a_rank_declared_lost_is_cut_off_when_it_resumes",
        "TestGrpcChannel::test_clean_close_is_not_a_loss",
        "TestGrpcChannel::test_concurrent_adds_give_an_exact_count",
        "TestGrpcChannel::test_concurrent_compare_set_has_one_winner",
        "TestGrpcChannel::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestGrpcChannel::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestGrpcChannel::test_frozen_peer_is_reported_as_peer_lost",
        "TestGrpcChannel::test_full_job_and_taken_rank_are_refused_naming_a_live_holder",
        "TestGrpcChannel::test_gloo_process_group_through_the_channel",
        "TestGrpcChannel::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestGrpcChannel::test_store_is_linearizable_under_kills_freezes_and_connection_resets",
        "TestGrpcChannel::test_the_store_through_node_relays_is_linearizable_under_kills_freezes_and_connection_resets",
    },
    "test_conformance_memory.py": {
        "TestMemoryChannel::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestMemoryChannel::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestMemoryChannel::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestMemoryChannel::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestMemoryChannel::test_barrier_timeout_says_how_many_arrived",
        "TestMemoryChannel::test_clean_close_is_not_a_loss",
        "TestMemoryChannel::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestMemoryChannel::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestMemoryChannel::test_only_control_errors_escape_when_the_coordinator_goes",
    },
    "test_conformance_tcpstore.py": {
        "TestTCPStoreChannel::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestTCPStoreChannel::test_a_channel_dropped_unclosed_after_its_coordinator_died_is_collected_without_a_hang",
        "TestTCPStoreChannel::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestTCPStoreChannel::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestTCPStoreChannel::test_a_connect_that_waits_says_what_it_waits_for",
        "TestTCPStoreChannel::test_a_connect_to_nothing_keeps_its_timeout",
        "TestTCPStoreChannel::test_a_frozen_rank_0_holds_no_call_of_another_rank_past_the_liveness_bound",
        "TestTCPStoreChannel::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestTCPStoreChannel::test_a_killed_peer_is_noticed_as_soon_as_the_transport_promises",
        "TestTCPStoreChannel::test_a_rank_declared_lost_is_cut_off_when_it_resumes",
        "TestTCPStoreChannel::test_a_rank_frozen_in_the_middle_of_its_writes_blocks_no_one",
        "TestTCPStoreChannel::test_a_rank_that_closed_after_its_part_does_not_end_a_collective",
        "TestTCPStoreChannel::test_a_rank_that_closed_without_entering_a_collective_ends_it_at_once",
        "TestTCPStoreChannel::test_barrier_timeout_says_how_many_arrived",
        "TestTCPStoreChannel::test_clean_close_is_not_a_loss",
        "TestTCPStoreChannel::test_collectives_clean_up_their_keys",
        "TestTCPStoreChannel::test_concurrent_adds_give_an_exact_count",
        "TestTCPStoreChannel::test_concurrent_compare_set_has_one_winner",
        "TestTCPStoreChannel::test_delete_reports_whether_the_key_existed",
        "TestTCPStoreChannel::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestTCPStoreChannel::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestTCPStoreChannel::test_frozen_peer_is_reported_as_peer_lost",
        "TestTCPStoreChannel::test_full_job_and_taken_rank_are_refused_naming_a_live_holder",
        "TestTCPStoreChannel::test_gloo_process_group_through_the_channel",
        "TestTCPStoreChannel::test_killed_peer_is_reported_as_peer_lost",
        "TestTCPStoreChannel::test_many_ranks_meet_in_every_collective",
        "TestTCPStoreChannel::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestTCPStoreChannel::test_peer_killed_before_rendezvous_is_reported_as_peer_lost",
        "TestTCPStoreChannel::test_ranks_are_unique_and_barriers_never_release_early_under_connection_resets",
        "TestTCPStoreChannel::test_ranks_joining_together_are_never_reported_lost",
        "TestTCPStoreChannel::test_store_is_linearizable_under_kills_freezes_and_connection_resets",
        "TestTCPStoreChannel::test_the_store_through_node_relays_is_linearizable_under_kills_freezes_and_connection_resets",
        "test_a_slow_new_connection_delays_the_join_and_never_costs_a_rank",
    },
    "test_status.py": {
        "test_a_job_behind_node_relays_is_seen_whole_by_status_and_its_launchers_event_file",
    },
    "test_conformance_relay.py": {
        "test_a_timed_out_barrier_counts_the_ranks_of_every_node",
        "TestRelayedMemory::test_barrier_timeout_says_how_many_arrived",
        "TestRelayedZmq::test_barrier_timeout_says_how_many_arrived",
        "TestRelayedMemory::test_gloo_process_group_through_the_channel",
        "TestRelayedMemory::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestRelayedZmq::test_concurrent_adds_give_an_exact_count",
        "TestRelayedZmq::test_concurrent_compare_set_has_one_winner",
        "TestRelayedZmq::test_gloo_process_group_through_the_channel",
        "TestRelayedZmq::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestRelayedMemory::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestRelayedZmq::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestRelayedMemory::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestRelayedZmq::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestRelayedZmq::test_a_connect_that_waits_says_what_it_waits_for",
        "TestRelayedMemory::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestRelayedMemory::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestRelayedZmq::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestRelayedZmq::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestRelayedZmq::test_a_connect_to_nothing_keeps_its_timeout",
        "TestRelayedZmq::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestRelayedMemory::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestRelayedZmq::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
    },
    "test_conformance_teeth.py": {
        "test_a_transport_atomic_only_within_a_process_fails_fast_naming_the_primitive",
    },
    "test_conformance_zmq.py": {
        "TestZmqChannel::test_a_channel_that_holds_no_rank_keeps_its_run",
        "TestZmqChannel::test_a_run_goes_on_when_the_rank_that_started_it_leaves",
        "TestZmqChannel::test_a_process_whose_connect_failed_exits_with_its_own_status",
        "TestZmqChannel::test_a_connect_that_waits_says_what_it_waits_for",
        "TestZmqChannel::test_a_connect_to_nothing_keeps_its_timeout",
        "TestZmqChannel::test_a_frozen_rank_0_holds_no_call_of_another_rank_past_the_liveness_bound",
        "TestZmqChannel::test_a_killed_jobs_rerun_under_the_same_name_starts_clean",
        "TestZmqChannel::test_a_rank_declared_lost_is_cut_off_when_it_resumes",
        "TestZmqChannel::test_clean_close_is_not_a_loss",
        "TestZmqChannel::test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark",
        "TestZmqChannel::test_a_wait_rides_out_a_coordinator_paused_for_a_moment",
        "TestZmqChannel::test_full_job_and_taken_rank_are_refused_naming_a_live_holder",
        "TestZmqChannel::test_gloo_process_group_through_the_channel",
        "TestZmqChannel::test_only_control_errors_escape_when_the_coordinator_goes",
        "TestZmqChannel::test_ranks_are_unique_and_barriers_never_release_early_under_connection_resets",
        "TestZmqChannel::test_store_is_linearizable_under_kills_freezes_and_connection_resets",
        "TestZmqChannel::test_the_store_through_node_relays_is_linearizable_under_kills_freezes_and_connection_resets",
    },
    "test_error_output.py": {
        "test_check_says_nothing_listens_in_its_own_words",
        "test_each_error_path_of_the_api_is_one_line",
        "test_launch_of_the_main_job_at_a_wrong_port_is_one_line",
    },
    "test_etcd_security.py": {
        "test_a_user_whose_role_covers_the_job_works_past_the_token_ttl",
        "test_check_names_each_misconfiguration_and_the_fix",
        "test_tls_misconfigurations_fail_typed_within_seconds",
    },
    "test_examples.py": {
        "test_the_main_job_through_node_relays_trains_as_it_does_directly",
        "test_allreduce_demo_runs",
        "test_the_language_model_example_snapshots_resumes_and_runs_under_torchrun",
        "test_the_torchrun_script_and_its_fabric_port_train_as_the_dp_fit_port_does",
    },
    "test_exits.py": {
        "test_a_frozen_peer_keeps_its_connections_and_is_lost_after_the_liveness_timeout",
        "test_a_peer_killed_in_another_pid_namespace_is_lost_after_the_grace",
    },
    "test_fuzz_state.py": {
        "test_coordinator_state_machine_at_its_limits",
        "test_coordinator_state_machine_in_process",
        "test_coordinator_state_machine_over_zmq",
    },
    "test_grpc.py": {
        "test_tls_job_works_and_mismatches_fail_clearly",
    },
    "test_hostile.py": {
        "test_a_job_cannot_exhaust_the_coordinator",
        "test_a_replayed_heartbeat_does_not_keep_a_dead_rank_alive",
        "test_a_replayed_request_is_never_applied_twice",
        "test_fuzzed_input_neither_crashes_the_coordinator_nor_disturbs_a_job",
        "test_hundreds_of_clients_and_two_jobs_with_the_same_keys",
        "test_reply_cache_is_bounded_in_bytes",
    },
    "test_hostile_more.py": {
        "test_a_curve_coordinator_under_attack_without_the_token_serves_its_jobs",
        "test_a_forged_rendezvous_state_is_refused_and_never_loaded",
        "test_a_genuine_rendezvous_state_of_another_run_is_refused",
        "test_a_replayed_older_rendezvous_state_is_refused",
        "test_etcd_keys_of_any_text_round_trip_and_stay_inside_the_job",
    },
    "test_launch.py": {
        "test_each_nodes_launcher_hosts_a_relay_its_workers_reach_the_job_through",
        "test_an_elastic_world_size_range_reaches_the_workers_training_options",
        "test_an_unmodified_torchrun_script_runs_under_launch",
        "test_help_and_version",
        "test_log_format_json_makes_every_output_line_a_json_object",
        "test_progress_goes_to_a_log_as_one_line_per_epoch",
    },
    "test_loop.py": {
        "test_a_checkpoint_from_before_positions_were_versioned_resumes_as_it_did",
        "test_a_checkpoint_resumes_at_another_world_size",
        "test_a_model_returning_a_tuple_trains_validates_and_resumes",
        "test_a_stop_signal_checkpoints_at_a_step_and_resuming_ends_as_uninterrupted",
        "test_a_users_sampler_shards_the_data_even_or_uneven",
        "test_data_parallel_training_equals_one_process_on_the_same_global_batches",
        "test_gradient_accumulation_equals_the_larger_batch",
        "test_mixed_precision_trains",
        "test_patience_stops_early_when_validation_stops_improving",
        "test_resume_equals_uninterrupted_bitwise",
        "test_what_a_real_training_script_needs",
    },
    "test_mpirun.py": {
        "test_check_env_says_what_mpirun_started",
        "test_the_digits_example_runs_unchanged_under_open_mpi",
    },
    "test_multihost.py": {
        "test_an_elastic_job_carries_on_without_a_host_cut_off_for_good",
        "test_check_across_hosts",
        "test_partition_of_one_host_and_its_healing",
        "test_training_across_hosts_matches_one_host",
    },
    "test_options.py": {
        "test_serve_refuses_each_misconfiguration_before_it_listens",
    },
    "test_reply_binding.py": {
        "test_a_request_bounced_back_is_not_its_reply",
    },
    "test_secrets.py": {
        "test_connect_with_every_argument_still_takes_the_configured_token",
        "test_no_secret_in_what_a_launch_over_ssh_shows",
        "test_no_secret_in_what_launch_serve_check_and_their_errors_show",
        "test_no_secret_in_what_the_torchrun_backends_show",
        "test_serve_and_check_take_the_configured_token",
        "test_the_torchrun_backend_takes_the_configured_token",
    },
    "test_slurm.py": {
        "test_check_env_says_what_slurm_started",
        "test_scancel_signal_term_checkpoints_and_the_job_started_again_resumes",
        "test_srun_tasks_as_node_launchers_each_host_its_nodes_relay",
        "test_the_digits_example_runs_unchanged_under_srun",
        "test_the_sbatch_example_runs_as_submitted",
        "test_two_jobs_or_two_steps_sharing_a_first_node_get_different_ports",
    },
    "test_ssh.py": {
        "test_a_host_that_cannot_run_the_job_is_named_before_anything_starts",
        "test_max_restarts_restarts_every_host_in_step",
        "test_one_command_trains_on_every_host_and_the_token_is_on_no_command_line",
        "test_stopping_the_one_launcher_stops_every_host",
        "test_the_first_failure_stops_the_other_hosts_with_its_exit_code",
    },
    "test_strategies.py": {
        "test_async_ps_a_slowed_worker_is_waited_for_only_at_the_staleness_bound",
        "test_async_ps_reaches_ddps_accuracy_on_the_digits_example",
        "test_async_ps_stopped_mid_epoch_trains_each_batch_once_on_any_number_of_workers",
        "test_async_ps_with_one_worker_is_sequential_sgd_bit_for_bit",
        "test_local_sgd_averaging_every_step_trains_as_ddp",
        "test_local_sgd_replicas_agree_at_epoch_ends_and_resume_exactly",
    },
    "test_third_party_transport.py": {
        "test_entry_point_transport_passes_the_conformance_suite",
    },
    "test_torchrun.py": {
        "test_an_agent_stopped_by_a_signal_closes_its_relay_at_once",
        "test_handlers_are_registered_with_torch",
        "test_two_torchrun_nodes_rendezvous_and_restart",
    },
    "test_zmq.py": {
        "test_a_frozen_coordinator_is_waited_for_not_diagnosed_as_misconfigured",
        "test_curve_encrypts_traffic_and_needs_the_same_token",
    },
}

#: File -> test classes run only by ``pytest --full`` (every test of each).
FULL_ONLY_CLASSES: dict[str, set[str]] = {
    "test_conformance_relay.py": {"TestRelayedGrpc", "TestRelayedTCPStore", "TestRelayedEtcd"},
}

#: The tests of the serial files the fast tier runs (the fast tier runs in one process, so
#: nothing else loads the machine while they judge liveness).
FAST_SERIAL: dict[str, set[str]] = {
    "test_faults.py": {"test_a_watcher_that_could_not_look_blames_no_peer_for_the_gap"},
    "test_elastic.py": {"test_fewer_survivors_than_min_world_size_end_the_job_saying_so"},
    "test_etcd.py": {"test_a_mutation_whose_reply_is_lost_is_applied_exactly_once"},
    "test_coordinator_death.py": {"test_standalone_coordinator_death_fails_clients_fast"},
    "test_recovery.py": {"test_without_restarts_the_failure_is_the_exit_code"},
    "test_relay.py": {"test_ranks_behind_relays_read_write_and_meet_as_one_job"},
}

#: Worker-seconds of the heaviest files of the parallel phase (``pytest --full -n 3 --dist
#: loadfile -m "not serial" --durations=0`` under coverage on 2 cores, 2026-11-28; 2,205 s in
#: all). Under pytest-xdist their tests are collected first, heaviest first, so that the
#: file-by-file scheduling (told to keep the order collected: conftest.py) hands them out
#: before the light files: a long file that starts last
#: (the third-party transports', alphabetically late) no longer leaves the other workers idle.
HEAVY_FIRST: dict[str, float] = {
    "test_conformance_tcpstore.py": 235,
    "test_loop.py": 204,
    "test_third_party_transport.py": 198,
    "test_multihost.py": 197,
    "test_slurm.py": 141,
    "test_torchrun.py": 155,
    "test_strategies.py": 137,
    "test_conformance_etcd.py": 131,
    "test_conformance_grpc.py": 120,
    "test_secrets.py": 99,
    "test_conformance_zmq.py": 89,
    "test_error_output.py": 87,
    "test_examples.py": 78,
    "test_fuzz_state.py": 71,
}
