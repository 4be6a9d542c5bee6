"""Pure cluster policies (routing, migration, elastic roles): the router and the simulator
import them unchanged."""
