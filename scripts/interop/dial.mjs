// Dial an echo-rl node from js-libp2p, then identify and ping it.
// Usage: node dial.mjs /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID
import './polyfill.mjs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { multiaddr } from '@multiformats/multiaddr'

const target = multiaddr(process.argv[2])
const node = await createLibp2p({
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), ping: ping() }
})
const identified = new Promise((resolve) => {
  node.addEventListener('peer:identify', (evt) => resolve(evt.detail))
})
const conn = await node.dial(target)
const info = await Promise.race([identified, new Promise((_, reject) => setTimeout(() => reject(new Error('identify timed out')), 10000))])
const rtt = await node.services.ping.ping(target)
console.log(JSON.stringify({
  connected: conn.remotePeer.toString(),
  encryption: conn.encryption,
  multiplexer: conn.multiplexer,
  identify_protocols: info.protocols,
  identify_agent: info.agentVersion,
  ping_ms: rtt
}))
await node.stop()
