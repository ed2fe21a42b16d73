"""The GPU fields the monitor's device rows draw, as gpuscale/control/sample_fields.py declares them: the
SM clock where the terminal is wide enough, and in every row's tooltip."""

from __future__ import annotations

from tui_helpers import frozen_app, frozen_home, frozen_template, opened_monitor, run_async, screen_text, settle  # noqa: F401 (fixtures)


def test_the_sm_clock_is_shown_in_a_wide_terminal_and_in_the_tooltip_of_a_narrow_one(frozen_home):
    home, _ = frozen_home

    async def scenario():
        from gpuscale.app.widgets.run_monitor import DeviceRow

        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await opened_monitor(pilot)
            await settle(pilot)
            gpu_lines = [line for line in screen_text(app).splitlines() if "GPU " in line and "GiB" in line]
            assert len(gpu_lines) == 8 and all("61°C" in line or "°C 1980 MHz" in line for line in gpu_lines)
            assert all(line.count("1980 MHz") == 1 for line in gpu_lines), gpu_lines

            await pilot.resize_terminal(80, 24)
            await settle(pilot)
            assert "MHz" not in screen_text(app)  # no room at 80 columns: the row keeps its other fields
            detail = app.screen.query(DeviceRow).first().query_one(".device-detail")
            assert "SM clock 1980 MHz" in str(detail.tooltip) and "utilization" in str(detail.tooltip)

    run_async(scenario())
