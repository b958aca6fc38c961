"""The MQTT plane: outbox, broker connection, publisher and command worker behind one small facade (`plane`).

    plane = MqttPlane(config.mqtt, device_id=..., db_path=..., dispatch=dispatcher.dispatch)

Each part is a module of its own (`client`, `commands`, `config`, `outbox`, `publisher`, `topics`, `plane`);
importers name the module, so this package file holds nothing and importing one part never loads the others.
"""
